"""The kernel table a backend registers: ``(op, variants, callable)`` rows with a :class:`Tuning` bound.

:data:`OPS` names what the table covers without importing Triton, so a backend can declare
its capabilities before any kernel module is loaded.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from zllm_kernels_triton.tuning import Tuning

#: The HF checkpoints' quantized formats (``zllm.weights.formats``) the kernels of
#: :mod:`.quant_hf` decode: ``linear`` and the fused MoE's expert stacks.
HF_FORMATS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")

#: ``(op, variants, "module:function")`` of every kernel, in registration order.
OPS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("rms_norm", ("f32",), "norm:rms_norm"),
    ("add_rms_norm", ("f32",), "norm:add_rms_norm"),
    ("rope", ("neox",), "rope:rope"),
    ("rope", ("gptj",), "rope:rope_gptj"),
    ("silu_mul", ("f32",), "activation:silu_mul"),
    ("attention", ("paged",), "attention:attention"),
    ("attention_sliding", ("paged",), "attention:attention_sliding"),
    ("linear", ("q8_0",), "quant_matmul:linear_q8_0"),
    ("linear", HF_FORMATS, "quant_hf:linear_quant_hf"),
    ("moe", ("f32", "f16", "bf16", "q8_0", *HF_FORMATS), "moe:moe"),
    ("mla_attention", ("paged",), "mla:mla_attention"),
    ("attention_sinks", ("paged",), "attention:attention_sinks"),
    ("swiglu_clamped", ("f32",), "activation:swiglu_clamped"),
    ("router_topk_softmax", ("f32",), "moe_biased:router_topk_softmax"),
    ("moe_clamped_swiglu", ("f32", "f16", "bf16", "q8_0", *HF_FORMATS), "moe_biased:moe_clamped_swiglu"),
)


def kernel_table(tuning: Tuning) -> list[tuple[str, tuple[str, ...], Callable]]:
    """Every kernel as ``(op, variants, callable)`` with ``tuning`` bound.

    Each callable has the op's signature (``zllm.capabilities.ops``) and is named
    ``zllm_kernels_triton.<module>:<function>[<tuning.name>]`` for the registry's
    ``--explain``. Importing the kernel modules here (not at package import) lets
    ``TRITON_INTERPRET`` be set before any ``@triton.jit`` runs.
    """
    rows = []
    for op, variants, ref in OPS:
        module, _, attr = ref.partition(":")
        fn = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        rows.append((op, variants, _bind(fn, tuning)))
    return rows


def _bind(fn: Callable, tuning: Tuning) -> Callable:
    """``fn`` with ``tuning=tuning`` bound, keeping ``fn``'s module and (labelled) qualified name."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        return fn(*args, tuning=tuning, **kwargs)

    kernel.__qualname__ = f"{fn.__qualname__}[{tuning.name}]"
    return kernel
