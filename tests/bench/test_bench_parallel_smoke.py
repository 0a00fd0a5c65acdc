"""Smoke test of the parallelism benchmark: bench/parallel.py end to end on stories260K with
tiny sizes. Checks the rows and the JSON only (every row ran, the TP = 2 row counted the
collectives a decode step makes); never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_parallel_prints_every_row_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "parallel.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "parallel.py"), "--model", "stories260k", "--new-tokens", "6",
         "--prompt-tokens", "8", "--batch", "2", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["TP=1", "TP=2", "comm", "PP=1", "PP=2"]
    assert rows["comm"]["collectives_per_step"] == rows["TP=2"]["collectives_per_step"]
    assert rows["comm"]["comm_ms_per_step"] > 0
    assert "collective_ms_per_step" not in rows["TP=1"]
    # stories260K has 5 layers: 2 all-reduces each, the embedding's, the logits' gather and
    # the step's 2 broadcasts.
    assert rows["TP=2"]["collectives_per_step"] == 5 * 2 + 1 + 1 + 2
    assert 0 < rows["TP=2"]["collective_share"] < 1
    assert all(r.get("tok_s", r.get("decode_tok_s", 1)) > 0 for r in rows.values())
    assert "TP=2 batch 1:" in proc.stdout and "comm only:" in proc.stdout
