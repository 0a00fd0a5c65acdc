"""Bound ops dispatch on (op, variant): a model bound to two variants of one op reaches each by
name and never gets a silent pick; weight ops dispatch on the weight's format."""

from __future__ import annotations

import pytest
import torch

from zllm.capabilities import Capability
from zllm.domain.linear import linear
from zllm.domain.ops import CORE_OPS, register_references
from zllm.domain.rope import apply_rope, apply_rope_gptj, default_inv_freq, rope_cos_sin
from zllm.kernels.bound import BoundOps
from zllm.kernels.registry import KernelRegistry
from zllm.spec.errors import BoundOpError, KernelNotFound

NEOX, GPTJ = Capability("rope", "neox"), Capability("rope", "gptj")


@pytest.fixture
def registry() -> KernelRegistry:
    reg = KernelRegistry()
    register_references(reg)
    reg.register("rope", "test", ("neox",), apply_rope, registered_by="test")
    reg.register("rope", "test", ("gptj",), apply_rope_gptj, registered_by="test")
    reg.register("linear", "test", ("f32", "f16"), linear, registered_by="test")
    return reg


def _rope_inputs():
    x = torch.randn(3, 2, 8)
    return (x, *rope_cos_sin(torch.arange(3), default_inv_freq(8, 10000.0)))


def test_two_bound_variants_are_each_reached_by_name(registry):
    ops = BoundOps(registry, "test", {NEOX, GPTJ}, ops=CORE_OPS)
    x, cos, sin = _rope_inputs()

    torch.testing.assert_close(ops.variant("rope", "neox")(x, cos, sin), apply_rope(x, cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(ops.variant("rope", "gptj")(x, cos, sin), apply_rope_gptj(x, cos, sin), rtol=0, atol=0)
    assert [e.capability for e in ops.explain()] == ["rope[gptj]", "rope[neox]"]


def test_calling_an_op_bound_in_two_variants_without_naming_one_raises(registry):
    ops = BoundOps(registry, "test", {NEOX, GPTJ}, ops=CORE_OPS)

    with pytest.raises(BoundOpError, match=r"rope is bound in several variants \(rope\[gptj\], rope\[neox\]\)"):
        ops.rope(*_rope_inputs())


@pytest.mark.parametrize("cap, fn", [(NEOX, apply_rope), (GPTJ, apply_rope_gptj)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_an_op_bound_in_one_variant_is_that_kernel(registry, cap, fn):
    ops = BoundOps(registry, "test", {cap}, ops=CORE_OPS)

    assert ops.rope is fn and ops.variant("rope", cap.variant) is fn


def test_a_variant_that_was_not_bound_raises_naming_the_bound_ones(registry):
    ops = BoundOps(registry, "test", {NEOX}, ops=CORE_OPS)

    with pytest.raises(BoundOpError, match=r"rope\[gptj\] is not bound for this model \(bound variants of rope: "
                                           r"rope\[neox\]\)"):
        ops.variant("rope", "gptj")


def test_a_weight_op_dispatches_on_the_weight_format_and_fills_the_optional_bias(registry):
    ops = BoundOps(registry, "test", {Capability("linear", "f32"), Capability("linear", "f16")}, ops=CORE_OPS)
    x, w = torch.randn(2, 4), torch.randn(3, 4)

    torch.testing.assert_close(ops.linear(x, w), x @ w.t())
    torch.testing.assert_close(ops.linear(x, w.half()), x @ w.half().float().t())
    with pytest.raises(KernelNotFound, match="no kernel 'linear' for backend 'test' and format 'bf16'"):
        ops.linear(x, w.bfloat16())
