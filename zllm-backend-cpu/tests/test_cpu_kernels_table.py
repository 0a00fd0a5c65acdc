"""The KERNELS table covers exactly the core capabilities, and every entry resolves."""

from __future__ import annotations

import importlib
from collections import Counter

from zllm.capabilities import Capability
from zllm.domain.ops import CORE_CAPABILITIES
from zllm.kernels.registry import KernelRegistry
from zllm_backend_cpu.kernels import CAPABILITIES, KERNELS, NATIVE_INVARIANT_KERNELS, NATIVE_KERNELS


def test_kernels_cover_exactly_core_capabilities():
    declared = [Capability(op, v) for op, variants, _ in KERNELS for v in variants]
    assert not [c for c, n in Counter(declared).items() if n > 1], "a capability is listed twice"
    assert set(declared) == CORE_CAPABILITIES
    assert CAPABILITIES == CORE_CAPABILITIES


def test_every_entry_resolves_and_registers():
    registry = KernelRegistry()
    for op, variants, impl in KERNELS:
        module, _, attr = impl.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), impl
        registry.register(op, "cpu", variants, impl, registered_by="zllm-backend-cpu")
    for cap in CORE_CAPABILITIES:
        assert callable(registry.lookup(cap.op, "cpu", cap.variant).fn)


def test_native_rows_serve_declared_capabilities_and_resolve():
    for op, variants, impl in NATIVE_KERNELS + NATIVE_INVARIANT_KERNELS:
        assert {Capability(op, v) for v in variants} <= CAPABILITIES, impl
        module, _, attr = impl.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), impl
