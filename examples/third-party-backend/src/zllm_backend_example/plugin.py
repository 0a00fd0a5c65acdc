"""Entry point of zllm-backend-example (group ``zllm``, name ``example``).

Three things make a backend plugin:

1. ``ZLLM_PLUGIN_API``: the plugin API this module targets. zllm skips, with a warning
   naming both versions, a plugin whose major it does not speak.
2. ``zllm_backends``: publish a :class:`BackendInfo` — a name, a lazy ``module:Class``
   reference and the capabilities (op[variant]) the backend runs. Pure data: nothing here
   touches a device.
3. ``zllm_register_kernels``: register one kernel per declared capability, as lazy
   ``module:function`` strings. A test in zllm checks the two agree.
"""

from zllm.plugin_api import BackendInfo, Capability, KernelRegistry, hookimpl

ZLLM_PLUGIN_API = "1.3"
BACKEND = "example"
DISTRIBUTION = "zllm-backend-example"

#: (op, variant, kernel) — the single table both hooks read, so declared capabilities and
#: registered kernels cannot drift apart.
KERNELS: tuple[tuple[str, str, str], ...] = (
    ("embedding", "f32", "zllm_backend_example.kernels:embedding"),
    ("linear", "f32", "zllm_backend_example.kernels:linear"),
    ("rms_norm", "f32", "zllm_backend_example.kernels:rms_norm"),
    ("add_rms_norm", "f32", "zllm_backend_example.kernels:add_rms_norm"),
    ("rope", "neox", "zllm_backend_example.kernels:rope"),
    ("rope", "gptj", "zllm_backend_example.kernels:rope_gptj"),
    ("attention", "paged", "zllm_backend_example.kernels:attention"),
    ("silu_mul", "f32", "zllm_backend_example.kernels:silu_mul"),
)

CAPABILITIES = frozenset(Capability(op, variant) for op, variant, _ in KERNELS)


@hookimpl
def zllm_backends() -> list[BackendInfo]:
    return [
        BackendInfo(
            name=BACKEND,
            factory="zllm_backend_example.backend:ExampleBackend",
            capabilities=CAPABILITIES,
            priority=-10,  # never preferred by `backend.name: auto` over a real backend
            description="example plugin: plain torch f32 kernels on the CPU",
        )
    ]


@hookimpl
def zllm_register_kernels(registry: KernelRegistry) -> None:
    for op, variant, impl in KERNELS:
        registry.register(op, BACKEND, (variant,), impl, registered_by=DISTRIBUTION)
