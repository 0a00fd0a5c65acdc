"""Entry point of the ``zllm-backend-cpu`` distribution (group ``zllm``, name ``cpu``).

Capabilities come from the static kernel table, so reading them imports no kernel code.
"""

from zllm.plugin_api import BackendInfo, KernelRegistry, hookimpl
from zllm_backend_cpu.kernels import CAPABILITIES, INVARIANT_AS_IS, INVARIANT_KERNELS, KERNELS

ZLLM_PLUGIN_API = "1.0"
BACKEND = "cpu"


@hookimpl
def zllm_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name=BACKEND,
            factory="zllm_backend_cpu.backend:CpuBackend",
            capabilities=CAPABILITIES,
            priority=0,
            description="torch CPU kernels; f32 compute, weights f32/f16/bf16/Q8_0/Q4_0",
        )
    ]


@hookimpl
def zllm_register_kernels(registry: KernelRegistry) -> None:
    for op, formats, impl in KERNELS:
        registry.register(op, BACKEND, formats, impl, registered_by="zllm-backend-cpu",
                          batch_invariant=op in INVARIANT_AS_IS)
    for op, formats, impl in INVARIANT_KERNELS:
        registry.register(op, BACKEND, formats, impl, priority=-1, registered_by="zllm-backend-cpu",
                          batch_invariant=True)
