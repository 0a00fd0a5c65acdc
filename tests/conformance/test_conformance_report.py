"""The conformance report's shape and the tolerance rules it applies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zllm.conformance.kernels import compare
from zllm.conformance.report import CaseResult, ConformanceReport, E2EResult, report_paths


def make_report() -> ConformanceReport:
    report = ConformanceReport("cpu", "cpu", {"seed": 0, "quick": True}, {"zllm-core": "0.1.0"})
    report.kernels = [
        CaseResult("pkg.k:linear", "linear[f32]", "T=1 N=3 K=4", "passed", 1e-7, 2e-6, 1e-2, 1e-2),
        CaseResult("pkg.k:linear", "linear[f32]", "T=7 N=3 K=4 | x=view", "failed", math.inf, math.inf, 1e-2, 1e-2,
                   "raised RuntimeError: boom"),
        CaseResult("pkg.k:linear", "linear[bf16]", "device", "skipped", detail="no bf16 here"),
        CaseResult("pkg.k:sample", "sample[f32]", "S=1 V=50", "passed", detail="contract held"),
    ]
    report.e2e = [
        E2EResult("tiny-llama", "(generated)", "passed", "exact", 1e-6, 1e-5, 1e-2, 1e-2, [1, 2], [1, 2]),
        E2EResult("stories260k", None, "skipped", detail="not found"),
    ]
    return report


def test_json_report_has_stable_keys_and_no_non_json_numbers():
    data = json.loads(make_report().to_json())  # allow_nan=False would have raised on inf

    assert list(data) == ["backend", "device", "passed", "settings", "environment", "summary", "kernels",
                          "kernel_summary", "e2e", "failures"]
    assert data["passed"] is False
    assert data["summary"]["kernel_cases_by_status"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert data["summary"]["models_by_status"] == {"passed": 1, "failed": 0, "skipped": 1}
    row = data["kernels"][1]
    assert row["max_abs_err"] == "inf" and row["status"] == "failed" and row["passed"] is False
    assert set(row) >= {"kernel", "capability", "case", "max_abs_err", "max_rel_err", "atol", "rtol", "detail"}
    assert data["kernel_summary"][0] == {"kernel": "pkg.k:linear", "capability": "linear[f32]", "cases": 2, "passed": 1,
                                         "skipped": 0, "max_abs_err": "inf", "max_rel_err": "inf", "priority": 0,
                                         "batch_invariant": False}
    assert data["e2e"][1]["status"] == "skipped" and data["e2e"][1]["detail"] == "not found"


def test_failures_name_each_failing_kernel_and_case_and_skips_do_not_fail():
    report = make_report()
    assert report.failures() == [
        "FAIL kernel pkg.k:linear linear[f32] [T=7 N=3 K=4 | x=view]: raised RuntimeError: boom"]
    report.kernels = [r for r in report.kernels if not r.failed]
    assert report.passed  # a skipped kernel case and a skipped model are not failures
    report.e2e.append(E2EResult("m", "/m", "failed", "exact", detail="greedy token 3 differs"))
    assert not report.passed and report.failures() == ["FAIL e2e m (/m): greedy token 3 differs"]


def test_markdown_lists_kernels_cases_and_models_with_escaped_cells():
    md = make_report().to_markdown()

    assert md.startswith("# zllm conformance: backend `cpu` — FAILED\n")
    assert "| `pkg.k:linear` | linear[f32] | 0 | 1/2 | inf | inf |" in md
    assert "| `pkg.k:linear` | linear[bf16] | 0 | 0/1 (1 skipped) | — | — |" in md
    assert "T=7 N=3 K=4 \\| x=view | **FAIL** |" in md
    assert "| stories260k | skipped |" in md and "not found" in md


def test_report_file_names(tmp_path: Path):
    assert report_paths("out/r.json") == (Path("out/r.json"), Path("out/r.md"))
    assert report_paths("out/r") == (Path("out/r.json"), Path("out/r.md"))
    assert report_paths("out/r.v1") == (Path("out/r.v1.json"), Path("out/r.v1.md"))
    json_path, md_path = make_report().write(tmp_path / "rep")
    assert json.loads(json_path.read_text())["backend"] == "cpu" and md_path.read_text().startswith("# zllm")


TOL = 2.0 ** -7  # atol = rtol: exact binary fractions, so the boundary case is exact


@pytest.mark.parametrize(("out", "passed"), [
    (2.0 + TOL + TOL * 2.0, True),  # exactly atol + rtol * |ref| away
    (2.0 - TOL - TOL * 2.0, True),
    (2.0 + TOL + TOL * 2.0 + 2.0 ** -20, False),
    (-2.0, False),
])
def test_tolerance_is_atol_plus_rtol_times_reference(out, passed):
    ok, max_abs, _, detail = compare([torch.tensor([out], dtype=torch.float64)],
                                     [torch.tensor([2.0], dtype=torch.float64)], TOL, TOL)
    assert ok is passed and max_abs == abs(out - 2.0)
    assert (detail == "") is passed


def test_relative_error_ignores_references_near_zero_and_nan_matches_nan():
    ok, max_abs, max_rel, _ = compare([torch.tensor([1e-4, 2.0, math.nan])], [torch.tensor([0.0, 2.01, math.nan])],
                                      1e-2, 1e-2)
    assert ok and max_abs == pytest.approx(0.01, rel=1e-3)
    assert max_rel == pytest.approx(0.01 / 2.01, rel=1e-3)  # not 1e-4 / 0
    ok, max_abs, _, detail = compare([torch.tensor([math.nan])], [torch.tensor([1.0])], 1e-2, 1e-2)
    assert not ok and max_abs == math.inf and "1 of 1 elements outside tolerance" in detail


@pytest.mark.parametrize(("out", "why"), [
    (torch.zeros(2, 3), "has shape (2, 3), expected (3, 2)"),
    (torch.zeros(3, 2, dtype=torch.bfloat16), "has dtype torch.bfloat16, expected torch.float32"),
])
def test_shape_and_dtype_mismatches_fail_with_infinite_error(out, why):
    ok, max_abs, max_rel, detail = compare([out], [torch.zeros(3, 2)], 1e-2, 1e-2)
    assert not ok and max_abs == max_rel == math.inf and why in detail


def test_output_on_another_device_than_the_backend_fails():
    ok, _, _, detail = compare([torch.zeros(2)], [torch.zeros(2)], 1e-2, 1e-2, [torch.device("cpu")],
                               torch.device("cuda", 0))
    assert not ok and "is on cpu, expected the backend's device cuda:0" in detail
