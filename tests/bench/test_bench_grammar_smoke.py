"""Smoke test of the grammar benchmark: bench/grammar.py end to end on stories260K, tiny sizes.

Checks the shape of the output only (a row per batch size and grammar, numeric cells, the
grammar-cost cells, the four first-token rows), that the grammar runs generated every token
the plain runs did and that their matchers ran; never timings.
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
def test_bench_grammar_prints_decode_rows_and_first_token_latencies(tmp_path: Path) -> None:
    out = tmp_path / "grammar.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "grammar.py"), "--model", "stories260k", "--prompt-tokens", "8",
         "--new-tokens", "6", "--batch", "1,2", "--repeats", "1", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()

    rows = [line.split() for line in lines if re.match(r"\d+\s+(none|json_schema)\s", line)]
    assert [(r[0], r[1]) for r in rows] == [("1", "none"), ("1", "json_schema"), ("2", "none"), ("2", "json_schema")]
    for r in rows:
        # decode tok/s, step ms, forward ms, sample ms; then matcher ms, grammar ms, % of step, step delta
        assert len(r) == 11 and all(re.fullmatch(NUMBER, c) for c in r[2:6]), r
        assert r[10] == str(int(r[0]) * 6), r  # every sequence generated all its tokens, grammar or not
        if r[1] == "none":
            assert r[6:10] == ["-"] * 4, r
        else:
            assert all(re.fullmatch(NUMBER, c) for c in r[6:8]), r
            assert all(re.fullmatch(r"[+-]" + NUMBER + "%", c) for c in r[8:10]), r

    head = next(i for i, line in enumerate(lines) if line.startswith("first-token latency"))
    # label, then first token ms, prepare ms, grammar ms
    first = {label: cells for label, *cells in (line.rsplit(None, 3) for line in lines[head + 1:] if line.strip())}
    assert list(first) == ["no grammar", "first grammar of the engine (token table + compile)",
                           "a schema not seen before (compile)", "the same schema again (cached)"]
    assert all(len(cells) == 3 and all(re.fullmatch(NUMBER, c) for c in cells) for cells in first.values()), first

    report = json.loads(out.read_text())
    for by in report["decode"].values():
        assert [r["finish_reasons"] for r in by["json_schema"]] == [["length"]]
        assert by["json_schema"][0]["generated_tokens"] == by["none"][0]["generated_tokens"]
        assert by["json_schema"][0]["per_step_ms"]["matcher"] > 0  # the grammar's matchers ran every step
        assert by["none"][0]["per_step_ms"]["matcher"] == 0
    latency = report["first_token"]
    assert len(latency["first_grammar"]["grammar_s"]) == 1 and len(latency["cached_schema"]["grammar_s"]) == 1
