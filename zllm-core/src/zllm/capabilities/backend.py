"""The minimal backend protocol and the static description a backend plugin publishes."""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from zllm.capabilities import Capability


@runtime_checkable
class Backend(Protocol):
    """What the runtime needs from a backend instance beyond its kernels.

    A backend class is constructed as ``cls(threads=N_or_None)``; it must also provide the
    classmethod ``unavailable_reason() -> str | None`` which is called *before*
    construction and returns why the backend cannot run here (``None`` = it can). A
    backend for a family of devices (``cuda``, ``rocm``, ``metal``) also takes
    ``device=None`` (its default device) or a torch device string such as ``"cuda:1"``.

    Optional: ``unsupported_capabilities(self) -> dict[str, str]``, for a backend whose
    static :attr:`BackendInfo.capabilities` hold for its device family but not for every
    device in it (bf16 weights need sm_80 on CUDA, a gfx90a-class GPU on ROCm, macOS 14 on
    Metal). Called on the constructed instance, so it may query the device; returns the
    declared capabilities (``op[variant]``) this device cannot run, each with the reason,
    and ``{}`` when it runs them all. The loader calls it after constructing the backend and
    before reading any weight, and raises
    :class:`~zllm.spec.errors.CapabilityError` (capability, backend, family and the reason)
    when the model needs one of them. A backend without the method runs everything it
    declares (the CPU backend).

    Optional (plugin API 1.1): ``available_memory_bytes(self) -> int``, the bytes its device
    can still allocate (a GPU backend asks its driver). The loader calls it before reading
    any weight when ``runtime.kv_cache.num_blocks`` is null and sizes the KV cache from it
    (:func:`zllm.engine.loader.auto_num_blocks`); a backend without it is sized from the
    host's available RAM, right for a CPU and for unified memory.
    """

    name: str
    device: torch.device

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Put a weight or cache tensor (any dtype) where the kernels expect it."""
        ...


@attrs.frozen
class BackendInfo:
    """A backend as published by the ``zllm_backends`` hook: pure data, no device touched.

    Attributes:
        name: the name users put in ``backend.name`` (``cpu``, ``cuda`` ...).
        factory: lazy ``"module:Class"`` reference to the :class:`Backend` class.
        capabilities: what the backend declares it runs; must agree with its kernels.
        priority: automatic selection picks the highest priority available backend.
        description: one line for ``zllm plugins``.
    """

    name: str
    factory: str
    capabilities: frozenset[Capability]
    priority: int = 0
    description: str = ""

    def load_class(self) -> type[Any]:
        """Import the backend class. Raises ImportError/AttributeError from the plugin."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)
