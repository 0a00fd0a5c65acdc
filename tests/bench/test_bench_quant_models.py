"""bench/quant_models.py end to end on the bench's llama-15m, one round, tiny sizes: the quantized HF
directories are written, every row runs (zllm on each directory and on the Q8_0 / Q4_0 GGUF, all
quantized and with bf16 embeddings and output, transformers on the FP8 directory), and the ratios
are filled in. Never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_runs_every_row_and_fills_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "quant_models.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "quant_models.py"), "--model", "llama-15m",
         "--layouts", "fp8-block,mxfp4", "--rounds", "1", "--prompt", "8", "--new-tokens", "4",
         "--no-bandwidth", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for name in ("zllm fp8-block", "zllm mxfp4", "zllm q8_0", "zllm q4_0", "zllm q8_0-bf16-ends",
                 "zllm q4_0-bf16-ends", "transformers fp8-block"):
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["prefill_tok_s"] > 0, rows[name]
    fp8 = rows["zllm fp8-block"]
    assert fp8["decode_vs_gguf"] > 0 and fp8["prefill_vs_q8_0"] > 0 and fp8["decode_vs_transformers"] > 0
    assert rows["zllm mxfp4"]["decode_vs_gguf"] > 0 and rows["zllm mxfp4"]["decode_vs_gguf_all"] > 0
    assert rows["zllm q8_0-bf16-ends"]["stored_bytes"] > rows["zllm q8_0"]["stored_bytes"]  # bf16 embeddings
    assert rows["zllm mxfp4"]["bytes_per_token"] < rows["zllm fp8-block"]["bytes_per_token"]  # 4 vs 8 bits
    assert "| zllm fp8-block |" in proc.stdout
