"""Entry point of the ``zllm-backend-cpu`` distribution (group ``zllm``, name ``cpu``).

Capabilities come from the static kernel table, so reading them imports no kernel code.
Registering kernels loads the native kernel library (a ``ctypes`` load of one small shared
object, no kernel module import) to decide whether its kernels can be registered; priorities
are in :mod:`zllm_backend_cpu.kernels`.
"""

from collections.abc import Collection

from zllm.plugin_api import BackendInfo, KernelRegistry, hookimpl
from zllm_backend_cpu.kernels import (
    CAPABILITIES,
    INVARIANT_AS_IS,
    INVARIANT_KERNELS,
    ISA_ROW_FORMATS,
    ISA_ROW_OPS,
    KERNELS,
    NATIVE_INVARIANT_AS_IS,
    NATIVE_INVARIANT_KERNELS,
    NATIVE_KERNELS,
)
from zllm_backend_cpu.kernels.native import isa_description, unavailable_reason

ZLLM_PLUGIN_API = "1.3"
BACKEND = "cpu"
DISTRIBUTION = "zllm-backend-cpu"


@hookimpl
def zllm_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name=BACKEND,
            factory="zllm_backend_cpu.backend:CpuBackend",
            capabilities=CAPABILITIES,
            priority=0,
            description="torch CPU kernels + native decode kernels (GEMV, norms, RoPE, paged attention); "
            "f32 compute, weights f32/f16/bf16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/K-quants",
        )
    ]


Rows = list[tuple[str, tuple[str, ...], str]]


def _pairs(rows: Rows) -> set[tuple[str, str]]:
    return {(op, fmt) for op, formats, _ in rows for fmt in formats}


def _register(registry: KernelRegistry, rows: Rows, *, priority: int, invariant_ops: Collection[str],
              noted: Collection[tuple[str, str]] = (), note: str | None = None) -> None:
    """Register ``rows``; the ``(op, format)`` pairs in ``noted`` carry ``note``."""
    for op, formats, impl in rows:
        plain = tuple(f for f in formats if (op, f) not in noted)
        marked = tuple(f for f in formats if (op, f) in noted)
        for group, group_note in ((plain, None), (marked, note)):
            if group:
                registry.register(op, BACKEND, group, impl, priority=priority, registered_by=DISTRIBUTION,
                                  batch_invariant=op in invariant_ops, note=group_note)


@hookimpl
def zllm_register_kernels(registry: KernelRegistry) -> None:
    every_op = {op for op, _, _ in KERNELS}
    reason = unavailable_reason()
    if reason is None:
        _register(registry, KERNELS, priority=0, invariant_ops=INVARIANT_AS_IS)
        _register(registry, INVARIANT_KERNELS, priority=-2, invariant_ops=every_op)
        # the row kernels with an AVX-512 version say which level runs (zllm run --explain)
        rows = {(op, fmt) for op in ISA_ROW_OPS for fmt in ISA_ROW_FORMATS}
        isa = isa_description()
        _register(registry, NATIVE_KERNELS, priority=1, invariant_ops=NATIVE_INVARIANT_AS_IS, noted=rows, note=isa)
        _register(registry, NATIVE_INVARIANT_KERNELS, priority=-1, invariant_ops=every_op, noted=rows, note=isa)
        return
    # Without the library, the torch kernels of the ops and formats it would serve say why they run.
    note = f"torch path: native kernels unavailable: {reason}"
    _register(registry, KERNELS, priority=0, invariant_ops=INVARIANT_AS_IS, noted=_pairs(NATIVE_KERNELS), note=note)
    _register(registry, INVARIANT_KERNELS, priority=-2, invariant_ops=every_op, noted=_pairs(NATIVE_INVARIANT_KERNELS),
              note=note)
