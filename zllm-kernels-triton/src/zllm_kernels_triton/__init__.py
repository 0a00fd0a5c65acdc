"""Portable Triton kernels for zllm's hot path, registered by the CUDA and ROCm backends.

``from zllm_kernels_triton import Tuning, kernel_table``: a backend builds a :class:`Tuning`
for its hardware and registers the rows of ``kernel_table(tuning)``. The raw kernels
:func:`write_kv`, :func:`paged_decode_attention` and :func:`paged_prefill_attention` are
exported too (imported on first use, so that importing this package loads no Triton kernel).
"""

from __future__ import annotations

import importlib

from zllm_kernels_triton.table import OPS, kernel_table
from zllm_kernels_triton.tuning import DOT_PRECISIONS, Tuning

_LAZY = {
    "write_kv": "kv_cache",
    "paged_decode_attention": "attention_decode",
    "paged_prefill_attention": "attention_prefill",
}

__all__ = ["DOT_PRECISIONS", "OPS", "Tuning", "kernel_table", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
