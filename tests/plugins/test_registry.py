"""The kernel registry: duplicates, replacement, reasons, misses, forced references."""

from __future__ import annotations

import logging

import pytest

import zllm.domain.linear
from zllm.kernels.registry import KernelRegistry
from zllm.plugins.host import PluginHost
from zllm.spec.errors import KernelNotFound


def test_duplicate_registration_raises_naming_the_first_registrant():
    reg = KernelRegistry()
    reg.register("linear", "acme", ("f32",), "torch:matmul", registered_by="zllm-backend-acme")
    with pytest.raises(ValueError,
                       match=r"already registered by zllm-backend-acme \(torch:matmul\); pass replace=True"):
        reg.register("linear", "acme", ("f32",), "torch:mm", registered_by="zllm-kernels-fast")
    assert reg.lookup("linear", "acme", "f32").entry.name == "torch:matmul"


def test_replace_true_replaces_and_logs_who_replaced_whom(caplog):
    reg = KernelRegistry()
    reg.register("linear", "acme", ("f32",), "torch:matmul", registered_by="zllm-backend-acme")
    with caplog.at_level(logging.WARNING, logger="zllm.kernels.registry"):
        reg.register("linear", "acme", ("f32",), "torch:mm", replace=True, registered_by="zllm-kernels-fast")
    assert "linear/acme/f32: zllm-kernels-fast (torch:mm) replaces zllm-backend-acme (torch:matmul)" in caplog.text
    choice = reg.lookup("linear", "acme", "f32")
    assert choice.entry.registered_by == "zllm-kernels-fast"
    assert [e.name for e in reg.entries()] == ["torch:mm"]


def test_lookup_returns_the_callable_and_why_it_was_chosen():
    import torch

    reg = KernelRegistry()
    reg.register("linear", "acme", ("f32", "f16"), "torch:matmul", registered_by="zllm-backend-acme")
    only = reg.lookup("linear", "acme", "f16")
    assert only.fn is torch.matmul
    assert only.reason == "only kernel registered for linear/acme/f16 (by zllm-backend-acme)"

    reg.register("linear", "acme", ("f32",), "torch:mm", priority=5, registered_by="zllm-kernels-fast")
    best = reg.lookup("linear", "acme", "f32")
    assert best.fn is torch.mm
    assert best.reason == "highest priority 5 for linear/acme/f32; also registered: torch:matmul (priority 0)"


def test_a_registration_note_follows_the_reason_whenever_that_kernel_is_chosen():
    reg = KernelRegistry()
    reg.register("linear", "acme", ("f16",), "torch:matmul", registered_by="zllm-backend-acme",
                 note="fast kernel unavailable: no compiler")
    assert reg.lookup("linear", "acme", "f16").reason == (
        "only kernel registered for linear/acme/f16 (by zllm-backend-acme); fast kernel unavailable: no compiler")
    reg.register("linear", "acme", ("f16",), "torch:mm", priority=-1, registered_by="zllm-backend-acme",
                 batch_invariant=True)
    assert reg.lookup("linear", "acme", "f16").reason.endswith("(priority -1); fast kernel unavailable: no compiler")
    assert "unavailable" not in reg.lookup("linear", "acme", "f16", batch_invariant=True).reason


def test_lookup_miss_raises_listing_what_is_registered_and_never_falls_back():
    reg = KernelRegistry()
    reg.register("linear", "acme", ("f32",), "torch:matmul")
    reg.register("linear", "other", ("q8_0",), "torch:matmul")
    with pytest.raises(KernelNotFound) as info:
        reg.lookup("linear", "acme", "q8_0")
    err = info.value
    assert (err.op, err.backend, err.fmt) == ("linear", "acme", "q8_0")
    assert err.registered == ["acme/f32", "other/q8_0"]
    assert "registered for 'linear': acme/f32, other/q8_0" in str(err)

    with pytest.raises(KernelNotFound, match=r"registered for 'rope': nothing"):
        reg.lookup("rope", "acme", "neox")


def test_force_reference_returns_the_core_f32_reference_and_says_so():
    host = PluginHost(entry_points=[])
    host.kernels.register("linear", "acme", ("q8_0",), "torch:matmul", registered_by="zllm-backend-acme")

    forced = host.kernels.lookup("linear", "acme", "q8_0", force_reference=True)

    assert forced.fn is zllm.domain.linear.linear
    assert forced.entry.backend == "reference" and forced.entry.registered_by == "zllm-core"
    assert "forced by config backend.force_reference" in forced.reason and "'acme'" in forced.reason
    assert host.kernels.lookup("linear", "acme", "q8_0").entry.name == "torch:matmul"


def test_registration_is_lazy_until_lookup():
    # a module that does not exist only fails when the kernel is first needed
    reg = KernelRegistry()
    reg.register("linear", "acme", ("f32",), "zllm_no_such_module_xyz:linear")
    assert reg.has("linear", "acme", "f32")
    with pytest.raises(ModuleNotFoundError, match="zllm_no_such_module_xyz"):
        reg.lookup("linear", "acme", "f32")
