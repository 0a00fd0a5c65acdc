"""Kernel tables: the torch kernels of this library, and the rows a GPU backend registers.

A row is ``(op, variants, "module:function")``. Registering the string imports nothing, so
a backend publishes its capabilities and kernels without loading torch device code or
Triton; :func:`capabilities` derives what the backend declares from the same rows it
registers, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from zllm.plugin_api import Capability, KernelRegistry

KernelRow = tuple[str, tuple[str, ...], str]

DENSE = ("f32", "f16", "bf16")
_PKG = "zllm_kernels_torch"

#: Every kernel of this library; each has its op's signature (``zllm.capabilities.ops``).
TORCH_KERNELS: tuple[KernelRow, ...] = (
    ("embedding", DENSE, f"{_PKG}.linear:embedding_dense"),
    ("embedding", ("q8_0",), f"{_PKG}.linear:embedding_q8_0"),
    ("linear", DENSE, f"{_PKG}.linear:linear_dense"),
    ("linear", ("q8_0",), f"{_PKG}.linear:linear_q8_0"),
    ("rms_norm", ("f32",), f"{_PKG}.norm:rms_norm"),
    ("add_rms_norm", ("f32",), f"{_PKG}.norm:add_rms_norm"),
    ("rope", ("neox",), f"{_PKG}.rope:rope_neox"),
    ("rope", ("gptj",), f"{_PKG}.rope:rope_gptj"),
    ("attention", ("paged",), f"{_PKG}.attention:attention"),
    ("attention_sliding", ("paged",), f"{_PKG}.attention:attention_sliding"),
    ("silu_mul", ("f32",), f"{_PKG}.activation:silu_mul"),
)

#: What the CUDA and ROCm backends take from this library; Triton kernels cover the rest.
GPU_TORCH_CAPABILITIES = ("embedding[f32]", "embedding[f16]", "embedding[bf16]", "embedding[q8_0]",
                          "linear[f32]", "linear[f16]", "linear[bf16]")

#: The capabilities that read bf16 weights: what a device without bf16 support withdraws.
BF16_WEIGHT_CAPABILITIES = ("embedding[bf16]", "linear[bf16]")


def torch_rows(wanted: Iterable[str]) -> list[KernelRow]:
    """One row per capability in ``wanted`` (``op[variant]``), from :data:`TORCH_KERNELS`.

    Raises:
        KeyError: a capability this library has no kernel for (names it).
    """
    by_cap = {f"{op}[{v}]": (op, (v,), impl) for op, variants, impl in TORCH_KERNELS for v in variants}
    return [by_cap[c] for c in wanted]


def kernel_attr(op: str, variant: str) -> str:
    """The module attribute a backend exposes a built kernel under: ``op_variant``."""
    return f"{op}_{variant}"


def lazy_rows(module: str, rows: Iterable[tuple[str, tuple[str, ...], object]]) -> list[KernelRow]:
    """Rows pointing at ``module``'s attributes :func:`kernel_attr` for each ``(op, variant)`` of ``rows``.

    ``module`` builds the kernels on import (:func:`named_kernels`), so only a lookup that
    resolves one of them imports it — and with it Triton.
    """
    return [(op, (v,), f"{module}:{kernel_attr(op, v)}") for op, variants, _ in rows for v in variants]


def named_kernels(table: Iterable[tuple[str, tuple[str, ...], Callable]]) -> dict[str, Callable]:
    """``{kernel_attr(op, variant): kernel}`` for a built table such as ``zllm_kernels_triton.kernel_table(tuning)``."""
    return {kernel_attr(op, v): fn for op, variants, fn in table for v in variants}


def capabilities(rows: Iterable[KernelRow]) -> frozenset[Capability]:
    """Every ``op[variant]`` the rows provide."""
    return frozenset(Capability(op, v) for op, variants, _ in rows for v in variants)


def register_rows(registry: KernelRegistry, backend: str, rows: Iterable[KernelRow], registered_by: str) -> None:
    """Register every row for ``backend``. Raises ValueError when two rows claim one key (registry)."""
    for op, variants, impl in rows:
        registry.register(op, backend, variants, impl, registered_by=registered_by)
