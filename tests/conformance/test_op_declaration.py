"""One declaration per op: a test-only op declared outside the core reaches the capability
list, the reference registrations, bound-op dispatch and ``zllm conformance`` with no other
edit; and the core's own tables are what its declarations say."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch

from tests.conformance.scale_op_plugin import SCALE, scale_reference
from zllm.capabilities import Capability
from zllm.capabilities.ops import OpDeclaration, OpTable
from zllm.conformance import run_conformance
from zllm.conformance.cases import cases_for
from zllm.domain.ops import CORE_CAPABILITIES, CORE_OPS, collect_ops
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost

ROOT = Path(__file__).resolve().parents[2]
TEST_OP = Capability("test_scale", "f32")


def _host(kernel_plugin: str) -> PluginHost:
    cpu = [ep for ep in metadata.entry_points(group="zllm") if ep.name == "cpu"]
    plugin = metadata.EntryPoint("test-scale", f"tests.conformance.scale_op_plugin:{kernel_plugin}", "zllm")
    return PluginHost(entry_points=[*cpu, plugin], ops=CORE_OPS.extended([SCALE]))


def test_a_declared_op_is_a_capability_with_a_registered_reference():
    host = _host("CorrectKernel")

    assert host.ops.capabilities == CORE_CAPABILITIES | {TEST_OP}
    ref = host.kernels.lookup("test_scale", "cpu", "f32", force_reference=True)
    assert ref.fn is scale_reference and ref.entry.registered_by == "zllm-core"


def test_a_declared_op_binds_and_runs_the_backend_kernel():
    host = _host("CorrectKernel")

    ops = BoundOps(host.kernels, "cpu", {TEST_OP}, ops=host.ops)

    x = torch.randn(2, 3)
    torch.testing.assert_close(ops.test_scale(x, 3.0), x * 3.0)
    assert [e.kernel for e in ops.explain()] == ["tests.conformance.scale_op_plugin:scale_kernel"]


def test_the_declared_case_generator_builds_cases_with_the_declared_argument_names():
    cases = cases_for("test_scale", "f32", seed=0, ops=CORE_OPS.extended([SCALE]))

    assert [c.label for c in cases] == ["T=3 K=5 factor=2", "T=7 K=64 factor=-0.5"]
    assert all(c.arg_names == ("x", "factor") for c in cases)


def test_conformance_checks_a_declared_op_and_passes_a_correct_kernel():
    report = run_conformance("cpu", host=_host("CorrectKernel"), ops=["test_scale"])

    assert [(r.capability, r.status) for r in report.kernels] == [("test_scale[f32]", "passed")] * 2
    assert report.passed


def test_conformance_fails_a_wrong_kernel_for_a_declared_op():
    report = run_conformance("cpu", host=_host("WrongKernel"), ops=["test_scale"])

    assert report.kernels and all(r.failed and r.capability == "test_scale[f32]" for r in report.kernels)
    assert not report.passed


def test_core_ops_are_collected_from_every_domain_module():
    assert collect_ops() == CORE_OPS
    assert CORE_OPS.names == ["add_rms_norm", "attention", "attention_sinks", "attention_sliding", "embedding",
                              "linear", "mla_attention", "moe", "moe_clamped_swiglu", "rms_norm", "rope",
                              "router_topk_softmax", "silu_mul", "swiglu_clamped"]
    assert CORE_OPS["rope"].reference_for("gptj") == "zllm.domain.rope:apply_rope_gptj"
    assert CORE_OPS["rope"].reference_for("neox") == "zllm.domain.rope:apply_rope"


def test_the_kernel_signatures_in_the_plugin_guide_are_the_declared_ones():
    guide = (ROOT / "docs" / "writing-a-backend-plugin.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| `(.+)` \|$", guide, flags=re.MULTILINE))

    assert rows == {op.name: op.signature for op in CORE_OPS.ops}


def test_an_op_declared_twice_is_refused():
    with pytest.raises(ValueError, match="op 'rope' is declared twice"):
        CORE_OPS.extended([CORE_OPS["rope"]])


@pytest.mark.parametrize("fields, message", [
    (dict(variants=()), "declares no variants"),
    (dict(weight_arg="w"), "weight_arg 'w' is not one of its args"),
    (dict(optional_args=("x",)), "must be the last of"),
    (dict(variant_references={"bf16": "m:f"}), r"variant_references for undeclared variants \['bf16'\]"),
])
def test_an_inconsistent_declaration_is_refused(fields, message):
    base = dict(name="op", variants=("f32",), args=("x", "y"), signature="", reference="m:f", cases="m:g")
    with pytest.raises(ValueError, match=message):
        OpDeclaration(**(base | fields))


def test_an_undeclared_op_is_a_key_error_naming_the_declared_ones():
    with pytest.raises(KeyError, match="no op 'softcap' is declared"):
        OpTable(()).__getitem__("softcap")
