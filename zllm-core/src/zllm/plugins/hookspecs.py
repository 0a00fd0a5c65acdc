"""zllm's hook specifications — the reference manual for plugin authors.

A plugin is a module named by an entry point in the group ``zllm``. The module declares
the plugin-API version it targets as ``ZLLM_PLUGIN_API = "MAJOR.MINOR"`` and implements
any of the hooks below with functions decorated by ``zllm.plugin_api.hookimpl``. A plugin
imports only :mod:`zllm.plugin_api`.

Hooks grow by opt-in arguments (pluggy passes only the arguments an implementation names):
new arguments may be added, existing ones are never renamed.

Lifecycle, in call order:

1. **discovery** — ``zllm_backends``, ``zllm_model_families``: called once after every
   entry point is loaded; pure data, no device is touched.
2. **load** — ``zllm_register_kernels``: called once per plugin host, right after
   discovery, before any model is loaded; registers lazy kernel references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from zllm.capabilities.backend import BackendInfo
    from zllm.domain.family import FamilyInfo
    from zllm.kernels.registry import KernelRegistry

#: The plugin API the core speaks. A plugin whose ``ZLLM_PLUGIN_API`` has another major
#: is skipped with a warning; a newer minor is accepted only if it is <= this minor.
PLUGIN_API_VERSION: tuple[int, int] = (1, 3)

PROJECT = "zllm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------- discovery


@hookspec
def zllm_backends() -> list[BackendInfo]:
    """Publish the backends this plugin provides.

    Called: once per plugin host, after all entry points are loaded.
    Parameters: none.
    Returns: a list of :class:`~zllm.capabilities.backend.BackendInfo` (may be empty).
    Semantics: all results are collected; two plugins publishing the same backend name is
    an error naming both plugins.
    """


@hookspec
def zllm_model_families() -> list[FamilyInfo]:
    """Publish the model families this plugin provides.

    Called: once per plugin host, after all entry points are loaded.
    Parameters: none.
    Returns: a list of :class:`~zllm.domain.family.FamilyInfo` (may be empty).
    Semantics: all results are collected; two families claiming the same HF ``model_type``
    is an error naming both. Each family's ``gguf_architectures`` (plugin API 1.1) are
    collected into ``PluginHost.gguf_maps``, through which every GGUF file is read; two
    families mapping one architecture, or a map to a ``model_type`` its family does not
    handle, is an error naming them.
    """


# ---------------------------------------------------------------------------- load


@hookspec
def zllm_register_kernels(registry: KernelRegistry) -> None:
    """Register kernels (lazy ``"module:function"`` references) in the host's registry.

    Called: once per plugin host, after discovery, before any model is loaded.
    Parameters:
        registry: the host's :class:`~zllm.kernels.registry.KernelRegistry`; call
            ``registry.register(op, backend, formats, impl, priority=..., registered_by=...)``.
    Returns: nothing.
    Semantics: every implementation is called. A backend must register a kernel for each
    capability it declares (a test checks it). Duplicate keys raise unless ``replace=True``.
    """
