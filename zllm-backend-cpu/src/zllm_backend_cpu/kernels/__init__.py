"""The CPU backend's kernel table: ``(op, formats/variants, "module:function")``.

The plugin module registers each row with the kernel registry (lazily: nothing here imports
a kernel module). :data:`CAPABILITIES` is derived from the table, so what the backend
declares is exactly what it registers.

Priorities of the ``linear`` kernels for one format, highest first (the registry picks the
highest; batch-invariant mode the highest batch-invariant one):

- 1: native GEMV (:data:`NATIVE_KERNELS`) — calls of up to 16 tokens (decode), otherwise the
  torch kernel; registered only when the native library loads;
- 0: torch (:data:`KERNELS`);
- -1: native GEMV, batch-invariant for any ``T`` (:data:`NATIVE_INVARIANT_KERNELS`); only when
  the library loads;
- -2: torch, batch-invariant (:data:`INVARIANT_KERNELS`).

The other ops follow the same rule: the native kernels (:data:`NATIVE_KERNELS`: RMSNorm, add +
RMSNorm, RoPE, SiLU-and-mul, paged attention, MLA decode, the native MoE FFN) at
priority 1 over the torch ones at 0; ``moe`` has batch-invariant kernels at -1 (native) and -2
(torch) as ``linear`` does.

When the native library is unavailable, the torch kernels of the ops and formats it would serve
carry the reason as their registry note, so ``zllm run --explain`` says why the torch path runs.
"""

from __future__ import annotations

from zllm.plugin_api import DTYPE_OF_FORMAT, FORMATS, Capability

_PKG = "zllm_backend_cpu.kernels"

DENSE = tuple(DTYPE_OF_FORMAT)
# every registered format: row-tile decoders in .linear (GGUF k-quants in .kquants, the HF
# checkpoints' formats in .quant_hf); tests/test_cpu_kernels_table.py checks each has one
QUANT_FORMATS = tuple(FORMATS)
# native GEMV (.gemv): one zllm_gemv_<format> each (csrc/gemv.c; the k-quants csrc/kquant_gemv.c),
# in the order of csrc/gemv.h's format enum
GEMV_FORMATS = (*DENSE, "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
# native GEMV + row-tile decode of the HF checkpoints' formats (.quant_gemv, csrc/quant_gemv.c)
QUANT_GEMV_FORMATS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")
# formats whose native row kernels (linear, moe) also have AVX-512 versions, chosen when the
# library loads (.native: ISA level); their registry note names the level in use
ISA_ROW_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *QUANT_GEMV_FORMATS)
ISA_ROW_OPS = ("linear", "moe", "moe_clamped_swiglu")

KERNELS: list[tuple[str, tuple[str, ...], str]] = [
    ("embedding", DENSE, f"{_PKG}.linear:embedding_dense"),
    ("embedding", QUANT_FORMATS, f"{_PKG}.linear:embedding_quant"),
    ("linear", DENSE, f"{_PKG}.linear:linear_dense"),
    ("linear", QUANT_FORMATS, f"{_PKG}.linear:linear_quant"),
    ("rms_norm", ("f32",), f"{_PKG}.norm:rms_norm"),
    ("add_rms_norm", ("f32",), f"{_PKG}.norm:add_rms_norm"),
    ("rope", ("neox",), f"{_PKG}.rope:rope"),
    ("rope", ("gptj",), f"{_PKG}.rope:rope_gptj"),
    ("attention", ("paged",), f"{_PKG}.attention:attention"),
    ("attention_sliding", ("paged",), f"{_PKG}.attention:attention_sliding"),
    ("mla_attention", ("paged",), f"{_PKG}.mla:mla_attention"),
    ("silu_mul", ("f32",), f"{_PKG}.activation:silu_mul"),
    ("moe", (*DENSE, *QUANT_FORMATS), f"{_PKG}.moe:moe"),
    ("attention_sinks", ("paged",), f"{_PKG}.attention_sinks:attention_sinks"),
    ("swiglu_clamped", ("f32",), f"{_PKG}.moe_biased:swiglu_clamped"),
    ("router_topk_softmax", ("f32",), f"{_PKG}.moe_biased:router_topk_softmax"),
    ("moe_clamped_swiglu", (*DENSE, *QUANT_FORMATS), f"{_PKG}.moe_biased:moe_clamped_swiglu"),
]

#: Ops of :data:`KERNELS` whose kernels are batch-invariant as they stand (see
#: :mod:`zllm_backend_cpu.kernels.invariant` for why); registered with ``batch_invariant=True``.
INVARIANT_AS_IS = frozenset({"embedding", "rms_norm", "add_rms_norm", "rope"})

#: Batch-invariant kernels for the other ops, registered at priority -2 with
#: ``batch_invariant=True``: chosen only when ``runtime.batch_invariant`` is on.
INVARIANT_KERNELS: list[tuple[str, tuple[str, ...], str]] = [
    ("linear", DENSE, f"{_PKG}.invariant:linear_dense_invariant"),
    ("linear", QUANT_FORMATS, f"{_PKG}.invariant:linear_quant_invariant"),
    ("attention", ("paged",), f"{_PKG}.invariant:attention_invariant"),
    ("attention_sliding", ("paged",), f"{_PKG}.invariant:attention_sliding_invariant"),
    ("mla_attention", ("paged",), f"{_PKG}.mla:mla_attention_invariant"),
    ("silu_mul", ("f32",), f"{_PKG}.invariant:silu_mul_invariant"),
    ("moe", (*DENSE, *QUANT_FORMATS), f"{_PKG}.moe:moe_invariant"),
    ("attention_sinks", ("paged",), f"{_PKG}.attention_sinks:attention_sinks_invariant"),
    ("swiglu_clamped", ("f32",), f"{_PKG}.moe_biased:swiglu_clamped_invariant"),
    ("router_topk_softmax", ("f32",), f"{_PKG}.moe_biased:router_topk_softmax_invariant"),
    ("moe_clamped_swiglu", (*DENSE, *QUANT_FORMATS), f"{_PKG}.moe_biased:moe_clamped_swiglu_invariant"),
]

#: Native kernels (:mod:`zllm_backend_cpu.kernels.native`), registered at priority 1 when the
#: library loads.
NATIVE_KERNELS: list[tuple[str, tuple[str, ...], str]] = [
    ("linear", GEMV_FORMATS, f"{_PKG}.gemv:linear_gemv"),
    ("linear", QUANT_GEMV_FORMATS, f"{_PKG}.quant_gemv:linear_quant_gemv"),
    ("rms_norm", ("f32",), f"{_PKG}.elementwise:rms_norm"),
    ("add_rms_norm", ("f32",), f"{_PKG}.elementwise:add_rms_norm"),
    ("rope", ("neox",), f"{_PKG}.elementwise:rope"),
    ("rope", ("gptj",), f"{_PKG}.elementwise:rope_gptj"),
    ("silu_mul", ("f32",), f"{_PKG}.elementwise:silu_mul"),
    ("attention", ("paged",), f"{_PKG}.paged_attention:attention"),
    ("attention_sliding", ("paged",), f"{_PKG}.paged_attention:attention_sliding"),
    ("mla_attention", ("paged",), f"{_PKG}.paged_mla:mla_attention"),
    ("attention_sinks", ("paged",), f"{_PKG}.paged_attention:attention_sinks"),
    ("moe", (*GEMV_FORMATS, *QUANT_GEMV_FORMATS), f"{_PKG}.moe_gemv:moe_gemv"),
    ("moe_clamped_swiglu", (*GEMV_FORMATS, *QUANT_GEMV_FORMATS), f"{_PKG}.moe_gemv:moe_clamped_swiglu_gemv"),
]

#: Ops of :data:`NATIVE_KERNELS` whose kernels are batch-invariant (each row alone, in a fixed
#: order: ``csrc/elementwise.c``).
NATIVE_INVARIANT_AS_IS = frozenset({"rms_norm", "add_rms_norm", "rope", "silu_mul"})

#: Batch-invariant native GEMV kernels, registered at priority -1 when the library loads.
NATIVE_INVARIANT_KERNELS: list[tuple[str, tuple[str, ...], str]] = [
    ("linear", GEMV_FORMATS, f"{_PKG}.gemv:linear_gemv_invariant"),
    ("linear", QUANT_GEMV_FORMATS, f"{_PKG}.quant_gemv:linear_quant_gemv_invariant"),
    ("moe", (*GEMV_FORMATS, *QUANT_GEMV_FORMATS), f"{_PKG}.moe_gemv:moe_gemv_invariant"),
    ("moe_clamped_swiglu", (*GEMV_FORMATS, *QUANT_GEMV_FORMATS), f"{_PKG}.moe_gemv:moe_clamped_swiglu_gemv_invariant"),
]

CAPABILITIES: frozenset[Capability] = frozenset(Capability(op, v) for op, variants, _ in KERNELS for v in variants)

__all__ = ["CAPABILITIES", "INVARIANT_AS_IS", "INVARIANT_KERNELS", "ISA_ROW_FORMATS", "ISA_ROW_OPS", "KERNELS",
           "NATIVE_INVARIANT_AS_IS", "NATIVE_INVARIANT_KERNELS", "NATIVE_KERNELS"]
