"""Smoke test of the speculative-decoding benchmark: bench/speculative.py end to end on
stories260K, tiny sizes, llama.cpp off. Checks the rows and the JSON only (every method ran,
the replay at acceptance 1.0 accepted everything, the always-wrong proposer nothing); never
timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_speculative_prints_every_method_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "speculative.py"), "--model", "stories260k", "--dtypes", "f32",
         "--batch", "2", "--new-tokens", "12", "--repeats", "1", "--acceptance", "1.0", "--wrong-k", "2",
         "--threads", "1", "--llama-cpp", "off", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kinds = [(r["batch"], r["method"], r["setting"]) for r in rows if r["model"] == "stories260k f32"]
    assert kinds == [(b, m, s) for b in (1, 2) for m, s in
                     (("none", "-"), ("replay", "K=4 p=1.0"), ("wrong", "K=4 adaptive"), ("wrong", "K=2 fixed"))]
    for r in rows:
        assert r["tok_s"] > 0, r
        if r["method"] == "replay":
            assert r["acceptance"] == 1.0, r
        if r["method"] == "wrong":
            assert r["acceptance"] in (0.0, None), r
    assert {r["method"] for r in rows if r["model"].startswith("stories260k f32 (story")} == {"none", "ngram", "draft"}
    assert "| stories260k f32 | 2 | replay | K=4 p=1.0 |" in proc.stdout
