"""bench/gpu_decode.py end to end at toy size on the CPU backend (the path the GPU run takes),
and its one-line error where the GPU backend cannot run. Checks the report's shape, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_decode.py"


def test_gpu_decode_reports_every_batch_size_of_a_tiny_model_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "cpu", "--device", "cpu", "--tiny",
                           "--batches", "1,3", "--prompt-tokens", "8", "--warmup", "1", "--steps", "4",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    model = report["model"]
    # hidden 64, 2 layers, 4 heads (2 KV), FFN 128, vocab 256, untied head
    layer = 2 * 64 + 64 * 64 * 2 + 2 * (32 * 64) + 3 * 64 * 128
    assert model["parameters"] == 2 * 256 * 64 + 64 + 2 * layer
    assert model["weight_bytes"] == 2 * model["parameters"]  # bf16
    assert [r["batch"] for r in report["runs"]] == [1, 3]
    for run in report["runs"]:
        assert run["steps"] == 4 and run["decode_tokens_per_s"] > 0 and 0 < run["weight_bandwidth_pct"]
        assert run["weight_bytes_per_step"] == model["weight_bytes"] - model["embedding_bytes"]
    assert "| 3 |" in (tmp_path / "gpu_decode.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_gpu_decode_without_the_device_is_one_error_line_naming_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr == "error: backend cuda: no CUDA device visible (torch.cuda.is_available() is False)\n"
