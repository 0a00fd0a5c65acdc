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


@pytest.mark.slow
def test_bench_serve_load_run_reports_statuses_ttft_rss_and_kv_after_the_load(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "serve.py"), "--model", "stories260k", "--load-s", "3",
         "--load-concurrency", "4", "--max-tokens", "8", "--threads", "1", "--rss-interval-s", "0.2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^load: 4 clients for .* requests .* — HELD$", proc.stdout, re.M), proc.stdout
    for line in ("statuses: ", "TTFT p50 ", "server RSS: ", "KV after the load: ",
                 "server exit status after SIGTERM: 0"):
        assert line in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    assert report["held"] and report["exit_status"] == 0 and not report["failures"]
    assert report["requests"] == sum(report["statuses"].values()) > 0
    assert set(report["by_route"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
    assert report["statuses"].get("200", 0) > 0 and report["ttft_p50_s"] is not None
    assert report["rss_mib"] and all(mib > 0 for _, mib in report["rss_mib"])
    assert report["kv_after"]["zllm_kv_blocks_running"] == 0
    assert report["kv_after"]["zllm_kv_blocks_free"] == report["kv_idle"]["zllm_kv_blocks_free"]
