"""bench/gpt_oss_moe.py end to end on the tiny gpt-oss shape, one round: the MXFP4 HF directory
and llama.cpp's converter's GGUF file of it are written, zllm runs both and transformers the
directory, and the ratios and bytes per token are filled in. Never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_runs_the_hf_gguf_and_transformers_rows(tmp_path: Path) -> None:
    out = tmp_path / "gpt_oss_moe.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpt_oss_moe.py"), "--size", "tiny", "--rounds", "1", "--prompt", "8",
         "--new-tokens", "4", "--no-bandwidth", "--no-llama-cpp", "--work", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for name in ("zllm hf-mxfp4", "zllm gguf-mxfp4", "transformers hf-mxfp4"):
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["prefill_tok_s"] > 0, rows[name]
    hf, gguf = rows["zllm hf-mxfp4"], rows["zllm gguf-mxfp4"]
    assert hf["vs_zllm_gguf"]["decode"] > 0 and hf["vs_transformers"]["prefill"] > 0
    # the tiny model: 4 experts, top-2 -> half of every expert stack is read a token
    stored = sum(f.stat().st_size for f in (tmp_path / "gpt-oss-tiny-mxfp4").glob("*.safetensors"))
    assert 0 < hf["bytes_per_token"] < stored
    assert 0 < gguf["bytes_per_token"] < (tmp_path / "gpt-oss-tiny-mxfp4.gguf").stat().st_size
    assert "| zllm gguf-mxfp4 |" in proc.stdout
