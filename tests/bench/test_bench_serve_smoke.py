"""Smoke test of the serving benchmark: bench/serve.py end to end on stories260K, tiny sizes.

Checks the shape of the table only (a row per concurrency level and mode, transformers'
batched row, numeric cells, ratio cells); never timings.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUMBER = r"\d+(\.\d+)?"


@pytest.mark.slow
def test_bench_serve_prints_a_row_per_level_and_transformers(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "serve.py"), "--model", "stories260k", "--prompt-tokens", "8",
         "--max-tokens", "4", "--concurrency", "1,2,4", "--batch-invariant", "off", "--threads", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("engine "):].splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in table[2:] if line.startswith(("zllm", "transformers"))]
    zllm = [r for r in rows if r[0] == "zllm serve"]
    assert [r[2] for r in zllm] == ["1 (sequential)", "2", "4"], table
    for r in zllm:
        assert r[1] == "bi=off" and len(r) == 10, r
        assert all(re.fullmatch(NUMBER, c) for c in r[3:8]), r  # tok/s, TTFT p50/p99, wall s, tokens
        assert r[7] == str(4 * 4), r  # 4 requests x 4 tokens, every one generated
        assert all(re.fullmatch(NUMBER + "x", c) for c in r[8:10]), r
    assert zllm[0][8] == "1.00x"
    hf = [r for r in rows if r[0] == "transformers"]
    assert len(hf) == 1 and hf[0][1:3] == ["batched", "4"] and hf[0][7] == "16", hf

    report = json.loads(out.read_text())
    levels = report["zllm"]["off"]["levels"]
    assert sorted(int(c) for c in levels) == [1, 2, 4]
    assert all(len(lv["ttft_s"]) == 4 for lv in levels.values())
    assert report["transformers"]["generated_tokens"] == 16
