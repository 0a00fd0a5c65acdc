"""The example third-party backend (examples/third-party-backend), discovered through its entry
point like an installed plugin, passes the conformance kit."""

from __future__ import annotations

from pathlib import Path

from tests.conformance.conftest import conformance, install_plugin, read_report

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_SRC = REPO / "examples" / "third-party-backend" / "src"


def test_example_backend_passes_the_kit(tmp_path: Path):
    # The distribution's metadata as pip would install it; the package itself from the source tree.
    site = install_plugin(tmp_path / "site", "example", "zllm_backend_example.plugin", dist="zllm-backend-example",
                          version="0.1.0")

    proc = conformance("--backend", "example", "--report", tmp_path / "example", pythonpath=[site, EXAMPLE_SRC])

    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = read_report(tmp_path / "example.json")
    assert report["environment"]["zllm-backend-example"] == "0.1.0"
    caps = {r["capability"] for r in report["kernel_summary"]}
    assert caps == {"embedding[f32]", "linear[f32]", "rms_norm[f32]", "add_rms_norm[f32]", "rope[neox]", "rope[gptj]",
                    "attention[paged]", "silu_mul[f32]"}
    assert all(r["kernel"].startswith("zllm_backend_example.kernels:") for r in report["kernel_summary"])
    models = {m["model"]: m for m in report["e2e"]}
    assert models["tiny-llama"]["status"] == models["stories260k"]["status"] == "passed"
    # It declares no attention_sliding: the sliding-window model is skipped, saying so, never passed.
    assert models["tiny-mistral-sliding"]["status"] == "skipped"
    assert "does not declare attention_sliding[paged]" in models["tiny-mistral-sliding"]["detail"]
