"""``zllm conformance`` through the installed console script: the CPU backend passes, a wrong
kernel installed as a plugin is caught and named, usage errors exit 2 with one clear line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.cli.conftest import one_line_error
from tests.conformance.conftest import conformance, install_plugin, read_report

# A kernel library for the cpu backend whose silu_mul forgets the gate's factor: silu(g) * u
# computed as sigmoid(g) * u. Registered above the CPU backend's own kernel (priority 5),
# as a faster third-party kernel would be.
WRONG_SILU = '''
    import torch
    from zllm.plugin_api import hookimpl

    ZLLM_PLUGIN_API = "1.0"

    def silu_mul_forgets_gate(gate, up):
        return torch.sigmoid(gate) * up

    @hookimpl
    def zllm_register_kernels(registry):
        registry.register("silu_mul", "cpu", ("f32",), __name__ + ":silu_mul_forgets_gate", priority=5,
                          registered_by="zllm-test-wrong-silu")
'''

GHOST_BACKEND = '''
    from zllm.plugin_api import BackendInfo, Capability, hookimpl

    ZLLM_PLUGIN_API = "1.0"

    class GhostBackend:
        name = "ghost"

        @classmethod
        def unavailable_reason(cls):
            return "no ghost accelerator in this machine"

    @hookimpl
    def zllm_backends():
        return [BackendInfo(name="ghost", factory=__name__ + ":GhostBackend",
                            capabilities=frozenset({Capability("silu_mul", "f32")}))]

    @hookimpl
    def zllm_register_kernels(registry):
        registry.register("silu_mul", "ghost", ("f32",), "torch.nn.functional:silu", registered_by=__name__)
'''


def test_cpu_backend_passes_and_reports_every_kernel_with_its_error(tmp_path: Path):
    from zllm_backend_cpu.kernels import INVARIANT_KERNELS, KERNELS

    proc = conformance("--backend", "cpu", "--report", tmp_path / "cpu.json")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conformance of backend 'cpu' on cpu: PASSED" in proc.stdout
    report = read_report(tmp_path / "cpu.json")
    markdown = (tmp_path / "cpu.md").read_text(encoding="utf-8")
    assert report["passed"] is True and report["failures"] == []
    # The kernels the CPU backend always registers, its lower-priority batch-invariant ones
    # included (a registry entry of every kind: tests/conformance/test_conformance_api.py).
    expected = {(impl, f"{op}[{f}]") for op, formats, impl in KERNELS + INVARIANT_KERNELS for f in formats}
    assert expected <= {(r["kernel"], r["capability"]) for r in report["kernel_summary"]}
    for row in report["kernels"]:
        assert row["passed"], row
        if not row["capability"].startswith("sample["):
            assert math.isfinite(row["max_abs_err"]) and math.isfinite(row["max_rel_err"]), row
    for kernel, cap in expected:
        assert f"| `{kernel}` | {cap} |" in markdown
    models = {m["model"]: m for m in report["e2e"]}
    assert set(models) == {"tiny-llama", "tiny-mistral-sliding", "stories260k"}
    for m in models.values():
        assert m["status"] == "passed" and m["mode"] == "exact", m
        assert m["tokens"] == m["reference_tokens"] and len(m["tokens"]) == 16
        assert m["max_abs_err"] <= m["atol"]


def test_wrong_kernel_from_a_plugin_fails_the_run_and_is_named(tmp_path: Path):
    site = install_plugin(tmp_path / "site", "wrong-silu", "zllm_test_wrong_silu", WRONG_SILU)

    proc = conformance("--backend", "cpu", "--ops", "silu_mul", "--quick", "--report", tmp_path / "r",
                       pythonpath=[site])

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    failing = [line for line in proc.stderr.splitlines() if line.startswith("FAIL ")]
    assert failing and all("zllm_test_wrong_silu:silu_mul_forgets_gate silu_mul[f32]" in line for line in failing)
    assert "conformance of backend 'cpu' on cpu: FAILED" in proc.stdout
    report = read_report(tmp_path / "r.json")
    by_kernel = {r["kernel"]: r for r in report["kernel_summary"]}
    assert by_kernel["zllm_test_wrong_silu:silu_mul_forgets_gate"]["passed"] == 0
    assert by_kernel["zllm_backend_cpu.kernels.activation:silu_mul"]["passed"] == by_kernel[
        "zllm_backend_cpu.kernels.activation:silu_mul"]["cases"] > 0
    assert report["e2e"] == [] and "--ops" in report["settings"]["e2e"]
    assert "**FAIL**" in (tmp_path / "r.md").read_text(encoding="utf-8")


def test_ops_matching_nothing_exits_2_instead_of_a_green_run():
    line = one_line_error(conformance("--backend", "cpu", "--ops", "nonsense"))
    assert line.startswith("error: --ops: nonsense matches no op backend 'cpu' registers kernels for (its ops: "
                           "add_rms_norm, attention")


@pytest.mark.parametrize(("args", "message"), [
    (("--backend", "nonesuch"), "error: backend 'nonesuch' is not provided by any loaded plugin (loaded backends: "),
    (("--backend", "cpu", "--device", "cuda:0"),
     "error: --device: backend 'cpu': the cpu backend runs on the host CPU only: device must be 'cpu' or unset, "
     "got 'cuda:0'"),
    (("--backend", "cpu", "--report", "/nonexistent-dir/r"), "error: --report: /nonexistent-dir: no such directory"),
])
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    # In-process through the CLI's main (the subprocess path is covered above).
    from zllm.cli.main import main

    assert main(["conformance", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_unavailable_backend_exits_2_with_its_own_reason(tmp_path: Path):
    site = install_plugin(tmp_path / "site", "ghost", "zllm_test_ghost_backend", GHOST_BACKEND)

    line = one_line_error(conformance("--backend", "ghost", pythonpath=[site]))

    assert line == "error: backend ghost: no ghost accelerator in this machine"
