"""The two hook implementations of a backend plugin, built from its kernel rows.

A backend plugin module assigns them to its hook names, and pluggy finds them there::

    zllm_backends, zllm_register_kernels = backend_hooks("cuda", "pkg.backend:CudaBackend", KERNELS, ...)

The published capabilities are computed from the same rows that are registered, so what a
backend declares is what it registers (``tests/plugins/test_installed_plugins.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from zllm.plugin_api import BackendInfo, KernelRegistry, hookimpl
from zllm_kernels_torch.table import KernelRow, capabilities, register_rows


def backend_hooks(name: str, factory: str, rows: list[KernelRow], *, priority: int, description: str,
                  registered_by: str) -> tuple[Callable[[], list[BackendInfo]], Callable[[KernelRegistry], None]]:
    """``(zllm_backends, zllm_register_kernels)`` for backend ``name`` whose class is ``factory``
    (``"module:Class"``) and whose kernels are ``rows``; ``registered_by`` names the distribution."""
    info = BackendInfo(name, factory, capabilities(rows), priority, description)

    @hookimpl
    def zllm_backends() -> list[BackendInfo]:
        return [info]

    @hookimpl
    def zllm_register_kernels(registry: KernelRegistry) -> None:
        register_rows(registry, name, rows, registered_by)

    return zllm_backends, zllm_register_kernels
