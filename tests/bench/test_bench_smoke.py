"""Smoke test of the benchmark harness: bench/run.py end to end on stories260K, tiny sizes.

Checks the shape of the output only (both engines, numeric ratios); never timings.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_runs_both_engines_and_prints_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--models", "stories260k",
         "--prompt-tokens", "8", "--new-tokens", "8", "--repeats", "1", "--threads", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("model "):]
    rows = [line.split() for line in table.splitlines() if line.startswith("stories260k")]
    engines = {row[1] for row in rows}
    assert {"zllm", "transformers", "zllm/transformers"} <= engines, table
    for row in rows:
        if row[1] in ("zllm", "transformers"):
            # prefill tok/s, decode tok/s, TTFT ms, peak RSS +MiB, load s, tokens
            assert all(re.fullmatch(r"-?\d+(\.\d+)?", cell) for cell in row[2:8]), row
            assert row[7] == "8", row  # every engine generated all 8 tokens
    ratio_row = next(row for row in rows if row[1] == "zllm/transformers")
    assert len(ratio_row) == 7 and all(re.fullmatch(r"\d+\.\d+x", c) for c in ratio_row[2:]), ratio_row

    report = json.loads(out.read_text())
    model = report["models"]["stories260k"]
    assert set(model["engines"]) == {"zllm", "transformers"}
    ratios = model["ratios"]["zllm"]
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_s", "peak_rss_growth_bytes"):
        assert isinstance(ratios[key], float) and ratios[key] > 0, (key, ratios)
    for engine in ("zllm", "transformers"):
        run = model["runs"][engine][0]
        assert run["prompt_tokens"] == 8 and run["generated_tokens"] == 8, run
