"""The CPU backend's kernel table: ``(op, formats/variants, "module:function")``.

The plugin module registers each row with the kernel registry (lazily: nothing here imports
a kernel module). :data:`CAPABILITIES` is derived from the table, so what the backend
declares is exactly what it registers.
"""

from __future__ import annotations

from zllm.plugin_api import Capability

_PKG = "zllm_backend_cpu.kernels"

QUANT_FORMATS = ("q8_0", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # decoders in .linear / .kquants

KERNELS: list[tuple[str, tuple[str, ...], str]] = [
    ("embedding", ("f32", "f16", "bf16"), f"{_PKG}.linear:embedding_dense"),
    ("embedding", QUANT_FORMATS, f"{_PKG}.linear:embedding_quant"),
    ("linear", ("f32", "f16", "bf16"), f"{_PKG}.linear:linear_dense"),
    ("linear", QUANT_FORMATS, f"{_PKG}.linear:linear_quant"),
    ("rms_norm", ("f32",), f"{_PKG}.norm:rms_norm"),
    ("rope", ("neox",), f"{_PKG}.rope:rope"),
    ("attention", ("paged",), f"{_PKG}.attention:attention"),
    ("attention_sliding", ("paged",), f"{_PKG}.attention:attention_sliding"),
    ("silu_mul", ("f32",), f"{_PKG}.activation:silu_mul"),
    ("sample", ("f32",), f"{_PKG}.sampling:sample"),
]

CAPABILITIES: frozenset[Capability] = frozenset(Capability(op, v) for op, variants, _ in KERNELS for v in variants)

__all__ = ["CAPABILITIES", "KERNELS"]
