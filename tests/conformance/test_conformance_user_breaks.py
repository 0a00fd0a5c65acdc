"""What a user or a backend author gets wrong, and what the kit must do about it: usage
mistakes are one ``error:`` line (exit 2) before anything runs; kernels that write their
inputs, samplers with the wrong distribution and kernels that exit are failures naming the
kernel; broken backend classes, probes, kernel imports, families and checkpoints are
reported, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import REPO
from tests.conformance.conftest import conformance, install_plugin, read_report
from zllm.capabilities.backend import BackendInfo
from zllm.capabilities.ops import AttentionMetadata
from zllm.conformance import run_conformance
from zllm.conformance.e2e import ModelSource, check_model, write_tiny_checkpoint
from zllm.conformance.kernels import check_kernels
from zllm.conformance.report import ConformanceReport, E2EResult, report_paths
from zllm.domain.attention import attention
from zllm.domain.family import FamilyInfo
from zllm.domain.linear import linear
from zllm.domain.norm import rms_norm
from zllm.engine.loader import load_model
from zllm.plugins.host import PluginHost
from zllm.spec.config import load_config
from zllm.spec.errors import BackendUnavailable, PluginError
from zllm_backend_cpu.backend import CpuBackend


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(allowlist=["cpu", "llama"])


# ---------------------------------------------------------------------------- usage errors


def _usage_error(argv: list[str], capsys) -> str:
    """Run ``zllm conformance ARGV`` in-process; assert exit 2 with one ``error:`` line; return it."""
    from zllm.cli.main import main

    try:
        code = main(["conformance", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1"], "argument --seed: expected an integer in [0, 2**64), got -1"),
    (["--seed", str(2**64)], f"argument --seed: expected an integer in [0, 2**64), got {2**64}"),
    (["--report", ""], "error: --report: needs a file name"),
    (["--report", "{tmp}"], "error: --report: {tmp} is a directory; give a file name such as {tmp}/conformance"),
    (["--report", "{tmp}/new/"], "error: --report: {tmp}/new/ is a directory"),
    (["--report", "{tmp}/taken"], "error: --report: {tmp}/taken.json is a directory"),
    (["--report", "{tmp}/file.txt/r"], "error: --report: {tmp}/file.txt: no such directory"),
    (["--ops", " , "], "error: --ops: names no op"),
    (["--model", ""], "error: --model: needs a path"),
    (["--model", "{tmp}/nope"], "error: --model: {tmp}/nope: no such file or directory"),
])
def test_usage_mistakes_exit_2_with_one_line_before_the_run(argv, message, tmp_path, capsys):
    (tmp_path / "taken.json").mkdir()
    (tmp_path / "file.txt").write_text("not a folder")
    argv = [a.format(tmp=tmp_path) for a in argv]

    line = _usage_error(["--backend", "cpu", *argv], capsys)

    assert message.format(tmp=tmp_path) in line


def test_report_named_md_or_json_in_any_case_gives_the_pair():
    assert report_paths("out/r.md") == (Path("out/r.json"), Path("out/r.md"))
    assert report_paths("R.JSON") == (Path("R.JSON"), Path("R.md"))


def test_auto_checks_the_backend_auto_picks_and_the_report_names_it(host):
    report = run_conformance("auto", host=host, ops=["rope"], quick=True)

    assert report.backend == "cpu" and report.passed
    assert report.settings["backend"].startswith("auto (chose cpu: auto: highest priority")
    # the torch kernels, and the native ones where the CPU backend's library loads
    modules = {r.kernel.split(":")[0] for r in report.kernels}
    assert "zllm_backend_cpu.kernels.rope" in modules
    assert modules <= {"zllm_backend_cpu.kernels.rope", "zllm_backend_cpu.kernels.elementwise"}


# ---------------------------------------------------------------------------- kernels


def rms_norm_in_place(x, weight, eps):
    x.copy_(rms_norm(x, weight, eps))
    return x


def add_rms_norm_updating_residual(x, residual, weight, eps):
    residual.add_(x)  # vLLM's fused_add_rms_norm convention, which zllm's op does not have
    return rms_norm(residual, weight, eps), residual


def linear_negating_weight(x, weight, bias):
    return linear(x, weight.neg_().neg(), bias)


def attention_clearing_block_tables(q, k, v, k_cache, v_cache, meta: AttentionMetadata):
    out = attention(q, k, v, k_cache, v_cache, meta)
    meta.block_tables.fill_(-1)
    return out


def rms_norm_exits(x, weight, eps):
    raise SystemExit(3)


@pytest.mark.parametrize(("op", "variant", "kernel", "detail"), [
    ("rms_norm", "f32", rms_norm_in_place, "changed its input x (a kernel writes only its outputs"),
    ("add_rms_norm", "f32", add_rms_norm_updating_residual, "changed its input residual"),
    ("linear", "f32", linear_negating_weight, "changed its input weight"),
    ("attention", "paged", attention_clearing_block_tables, "changed its input meta"),
    ("rms_norm", "f32", rms_norm_exits, "raised SystemExit: 3"),
], ids=lambda v: getattr(v, "__name__", None))
def test_kernel_that_writes_an_input_or_exits_fails_naming_it(host, op, variant, kernel, detail):
    host.kernels.register(op, "cpu", (variant,), kernel, priority=5, registered_by="test")

    report = run_conformance("cpu", host=host, ops=[op], quick=True)

    name = f"{__name__}:{kernel.__name__}"
    mine = [r for r in report.kernels if r.kernel == name and r.capability == f"{op}[{variant}]"]
    # Every case of a kernel that writes its input fails.
    assert mine and all(r.failed and detail in r.detail for r in mine)
    assert not report.passed
    assert all(r.passed for r in report.kernels if r.kernel != name)  # the CPU backend's own kernels


# ---------------------------------------------------------------------------- broken backends


class BackendWithoutDevice:
    """Has what an older guide listed (``unavailable_reason``, ``place``) but no ``device``."""

    name = "bare"

    def __init__(self, threads=None):
        self.threads = threads

    @classmethod
    def unavailable_reason(cls):
        return None

    def place(self, tensor):
        return tensor


class BackendWhoseProbeCrashes(BackendWithoutDevice):
    @classmethod
    def unavailable_reason(cls):
        raise RuntimeError("probe crashed")


class CpuBackendWhoseDeviceQueryCrashes(CpuBackend):
    def unsupported_capabilities(self):
        raise RuntimeError("device query failed")


def _publish(host: PluginHost, name: str, cls: type, priority: int = 0) -> None:
    host.backends[name] = BackendInfo(name=name, factory=f"{__name__}:{cls.__name__}",
                                      capabilities=host.backends["cpu"].capabilities, priority=priority)


def test_backend_without_a_device_is_a_plugin_error_in_conformance_and_at_load(host, tmp_path):
    _publish(host, "bare", BackendWithoutDevice)
    message = rf"backend 'bare' \({__name__}:BackendWithoutDevice\) has no 'device' attribute"
    config = tmp_path / "bare.yaml"
    config.write_text(f"schema_version: 1\nmodel:\n  path: {REPO / 'assets/models/stories260k/hf'}\n"
                      "backend:\n  name: bare\n", encoding="utf-8")

    with pytest.raises(PluginError, match=message):
        run_conformance("bare", host=host, ops=["rope"])
    with pytest.raises(PluginError, match=message):
        load_model(load_config(config), host)


def test_availability_probe_that_raises_makes_the_backend_unavailable_with_the_error(host):
    _publish(host, "crashy", BackendWhoseProbeCrashes, priority=100)  # auto would try it first

    with pytest.raises(BackendUnavailable, match=r"BackendWhoseProbeCrashes.unavailable_reason\(\) raised "
                                                 r"RuntimeError: probe crashed"):
        run_conformance("crashy", host=host, ops=["rope"])
    assert run_conformance("auto", host=host, ops=["rope"], quick=True).backend == "cpu"  # auto skips it


def test_device_query_that_raises_is_a_plugin_error_naming_the_class(host):
    with pytest.raises(PluginError, match=r"CpuBackendWhoseDeviceQueryCrashes.unsupported_capabilities\(\) failed: "
                                          r"RuntimeError: device query failed"):
        check_kernels(host.kernels, host.backends["cpu"], CpuBackendWhoseDeviceQueryCrashes(threads=1), seed=0,
                      quick=True, ops={"rope"})


# ---------------------------------------------------------------------------- models


class ExplodingFamily:
    def parse_config(self, config, path):
        raise RuntimeError("parse_config exploded")


@pytest.fixture
def tiny(tmp_path) -> ModelSource:
    return ModelSource("tiny", write_tiny_checkpoint(tmp_path / "tiny", seed=0, sliding_window=None))


def test_checkpoint_without_the_tensors_a_family_needs_fails_that_model(host):
    vocab_only = REPO / "assets/models/llama.cpp-vocab/ggml-vocab-llama-spm.gguf"

    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), ModelSource("vocab", vocab_only))

    assert result.status == "failed"
    assert result.detail.startswith("checkpoint rejected: ") and "missing from the checkpoint" in result.detail


def test_kernel_that_fails_to_import_fails_the_model_naming_the_capability(host, tiny):
    host.kernels.register("silu_mul", "cpu", ("f32",), "zllm_no_such_module:silu_mul", priority=5)

    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), tiny)

    assert result.status == "failed"
    assert result.detail.startswith("load failed: backend 'cpu': the kernel for silu_mul[f32] failed to import: "
                                    "ModuleNotFoundError")


def test_family_code_that_raises_fails_the_model_instead_of_the_run(host, tiny):
    host.families["exploding"] = FamilyInfo("exploding", ("exploding",), f"{__name__}:ExplodingFamily")
    config = tiny.path / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_type": "exploding"}), encoding="utf-8")

    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), tiny)

    assert result.status == "failed"
    assert result.detail.startswith("raised RuntimeError: parse_config exploded (at ")


# ---------------------------------------------------------------------------- a third-party plugin

# Written from docs/writing-a-backend-plugin.md: one table drives both hooks, except that the
# author declared silu_mul[f32] without registering its kernel, and the rms_norm kernel
# forgets the weight.
HALF_DONE_BACKEND = '''
    import torch
    from zllm.plugin_api import BackendInfo, Capability, hookimpl

    ZLLM_PLUGIN_API = "1.0"
    DECLARED = {("rms_norm", "f32"), ("silu_mul", "f32")}

    class HalfDoneBackend:
        name = "halfdone"
        device = torch.device("cpu")

        def __init__(self, threads=None):
            self.threads = threads

        @classmethod
        def unavailable_reason(cls):
            return None

        def place(self, tensor):
            return tensor

    def rms_norm_forgets_weight(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)

    @hookimpl
    def zllm_backends():
        return [BackendInfo(name="halfdone", factory=__name__ + ":HalfDoneBackend",
                            capabilities=frozenset(Capability(o, v) for o, v in DECLARED))]

    @hookimpl
    def zllm_register_kernels(registry):
        registry.register("rms_norm", "halfdone", ("f32",), __name__ + ":rms_norm_forgets_weight",
                          registered_by="zllm-test-halfdone")
'''


def test_third_party_backend_with_a_wrong_and_a_missing_kernel_fails_naming_both(tmp_path: Path):
    site = install_plugin(tmp_path / "site", "halfdone", "zllm_test_halfdone", HALF_DONE_BACKEND)

    proc = conformance("--backend", "halfdone", "--quick", "--report", tmp_path / "halfdone.md", pythonpath=[site])

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("FAIL    (none) silu_mul[f32]: 0/1 cases, backend 'halfdone' declares silu_mul[f32] but registers no "
            "kernel for it") in proc.stdout.splitlines()
    failing = [line for line in proc.stderr.splitlines() if line.startswith("FAIL ")]
    assert any(line.startswith("FAIL kernel zllm_test_halfdone:rms_norm_forgets_weight rms_norm[f32] [")
               for line in failing)
    assert any(line.startswith("FAIL kernel (none) silu_mul[f32] [declared capability]") for line in failing)
    report = read_report(tmp_path / "halfdone.json")
    assert report["failures"] == failing and report["passed"] is False
    # It runs no model (it declares two ops): every model is skipped, saying so, never passed.
    assert [m["status"] for m in report["e2e"]] == ["skipped"] * 3
    assert "**FAIL**" in (tmp_path / "halfdone.md").read_text(encoding="utf-8")


def test_failure_line_of_a_generated_model_shows_its_path_in_one_pair_of_parentheses():
    report = ConformanceReport("cpu", "cpu", e2e=[E2EResult("tiny-llama", "(generated: random weights, seed 0)",
                                                            "failed", detail="greedy token 0 differs")])

    assert report.failures() == ["FAIL e2e tiny-llama (generated: random weights, seed 0): greedy token 0 differs"]
