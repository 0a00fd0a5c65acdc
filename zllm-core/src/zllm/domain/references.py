"""Registers every f32 reference under the pseudo-backend ``reference``.

One implementation per capability op, registered for every variant of that op in
:data:`~zllm.capabilities.CORE_CAPABILITIES` (weight formats for ``linear``/``embedding``,
math variants otherwise), unless :data:`REFERENCE_VARIANT_IMPLS` names one for the variant. Implementations are lazy ``"module:function"`` strings.
"""

from __future__ import annotations

from zllm.capabilities import CORE_CAPABILITIES
from zllm.kernels.registry import REFERENCE_BACKEND, KernelRegistry

#: op -> ``"module:function"`` of its f32 reference.
REFERENCE_IMPLS: dict[str, str] = {
    "embedding": "zllm.domain.linear:embedding",
    "linear": "zllm.domain.linear:linear",
    "rms_norm": "zllm.domain.norm:rms_norm",
    "add_rms_norm": "zllm.domain.norm:add_rms_norm",
    "rope": "zllm.domain.rope:apply_rope",
    "attention": "zllm.domain.attention:attention",
    "attention_sliding": "zllm.domain.attention:sliding_window_attention",
    "silu_mul": "zllm.domain.activation:silu_mul",
    "sample": "zllm.domain.sampling:sample",
}


#: ``op[variant]`` -> reference, where a variant's math differs from the op's other variants.
REFERENCE_VARIANT_IMPLS: dict[str, str] = {
    "rope[gptj]": "zllm.domain.rope:apply_rope_gptj",
}


def reference_variants() -> dict[str, tuple[str, ...]]:
    """op -> its sorted variants in CORE_CAPABILITIES."""
    variants: dict[str, list[str]] = {}
    for cap in sorted(CORE_CAPABILITIES):
        variants.setdefault(cap.op, []).append(cap.variant)
    return {op: tuple(v) for op, v in variants.items()}


def register_references(registry: KernelRegistry) -> None:
    """Register the reference of every core capability on ``registry`` (backend ``reference``).

    Raises:
        ValueError: a core capability op has no reference (names it), or one is already
            registered (from :meth:`KernelRegistry.register`).
    """
    variants = reference_variants()
    missing = sorted(set(variants) - set(REFERENCE_IMPLS))
    if missing:
        raise ValueError(f"core capability ops without an f32 reference: {missing}")
    for op, formats in variants.items():
        for fmt in formats:
            impl = REFERENCE_VARIANT_IMPLS.get(f"{op}[{fmt}]", REFERENCE_IMPLS[op])
            registry.register(op, REFERENCE_BACKEND, (fmt,), impl, registered_by="zllm-core")
