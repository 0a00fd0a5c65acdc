"""Smoke test of the benchmark harness: bench/run.py end to end on stories260K, tiny sizes,
with the batched-throughput table and the decode profile.

Checks the shape of the output only (rows, numeric cells, ratios, files); never timings.
llama.cpp is left out (building it takes minutes).
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


def _rows(markdown: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith(f"| {first_cell} ")]


@pytest.mark.slow
def test_bench_measures_both_engines_batches_and_profiles(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--models", "stories260k", "--dtypes", "f32",
         "--engines", "zllm,transformers", "--prompt-tokens", "8", "--new-tokens", "8", "--repeats", "1",
         "--threads", "1", "--batch", "1,2", "--batch-model", "stories260k", "--profile", "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    markdown = out.with_suffix(".md").read_text()
    assert markdown in proc.stdout

    generation = markdown.split("## Batch-1 generation", 1)[1].split("\n## ", 1)[0]
    assert "## Targets" in markdown
    rows = _rows(generation, "stories260k")
    by_engine = {r[2]: r for r in rows}
    assert set(by_engine) == {"zllm", "transformers f32", "zllm/transformers"}, rows
    for engine in ("zllm", "transformers f32"):
        r = by_engine[engine]
        # prefill tok/s, decode tok/s, TTFT ms, load s, peak RSS +MiB
        assert all(re.match(NUMBER, c) for c in r[3:8]), r
        assert re.fullmatch(r"\d+%", r[8]), r  # % of the bandwidth limit
        assert r[9] == "8", r  # every engine generated all 8 tokens
    assert re.fullmatch(r"\d+/8", by_engine["zllm"][10]), by_engine["zllm"]  # tokens equal to transformers'
    assert all(re.fullmatch(NUMBER + "x", c) for c in by_engine["zllm/transformers"][3:8])

    # engine, sequences, decode tok/s, vs 1 sequence, overall tok/s, TTFT p50 ms, zllm/transformers
    batch = {(r[0], r[1]): r for r in _rows(markdown, "zllm") + _rows(markdown, "transformers") if len(r) == 7}
    assert set(batch) == {("zllm", "1"), ("zllm", "2"), ("transformers", "1"), ("transformers", "2")}, batch
    assert batch[("zllm", "1")][3] == "1.00x" and re.fullmatch(NUMBER + "x", batch[("zllm", "2")][6])
    assert all(re.match(NUMBER, r[2]) and re.match(NUMBER, r[4]) for r in batch.values()), batch

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["bandwidth"]["dram_gb_s"] > 0 and report["bandwidth"]["cache_gb_s"] > 0
    row = report["models"]["stories260k"]["dtypes"]["f32"]
    assert row["file"]["bytes_per_token"] > 0
    assert row["ratios"]["transformers"]["decode_tok_s"] > 0
    assert row["runs"]["zllm"][0]["generated_tokens"] == 8
    assert report["batch"]["engines"]["zllm"]["2"]["generated_tokens"] == 16

    profile = report["profiles"]["stories260k/f32"]
    wall = profile["wall"]["median_ms"]
    assert profile["wall"]["decode_steps"] == 7
    assert wall["forward"] > 0 and wall["op.linear"] > 0 and wall["interval"] >= wall["step"]
    assert any(r["name"] == "op.attention" for r in profile["torch_profile_top"])
    assert Path(profile["out"]).with_suffix(".txt").stat().st_size > 0
