"""``zllm run --chat``: stdin lines are user turns, replies go to stdout, and the second turn
reuses the first turn's KV cache (``cached tokens`` on stderr)."""

from __future__ import annotations

import os
import re
import subprocess

from tests.cli.conftest import REPO, ZLLM, one_line_error, zllm
from tests.conftest import CONFIGS, write_config
from tests.e2e.test_chat import make_chat_checkpoint


def _run_chat(cfg, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ZLLM_PLUGINS"}
    return subprocess.run([*ZLLM, "run", "--config", str(cfg), "--chat", *extra], input=stdin, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_two_stdin_lines_give_two_replies_and_the_second_reuses_the_cache(tmp_path):
    d = make_chat_checkpoint(tmp_path)
    cfg = write_config(tmp_path, d, generation={"max_new_tokens": 6, "temperature": 0.0})
    proc = _run_chat(cfg, "Once upon a time\n\nTell me more\n", "--system", "Lily tells stories.")
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stderr.splitlines() if line.startswith("prompt tokens:")]
    assert len(stats) == 2, proc.stderr  # the blank line is not a turn
    assert "> " not in proc.stderr  # no prompt marker when stdin is not a terminal
    (p1, c1), (p2, c2) = [tuple(map(int, re.search(r"prompt tokens: (\d+), cached tokens: (\d+)", s).groups()))
                          for s in stats]
    assert c1 == 0 and c2 > 0 and p2 > p1
    assert all("generated tokens: 6" in s for s in stats)
    assert proc.stdout.count("\n") >= 2 and proc.stdout.strip()


def test_chat_on_a_base_model_without_template_is_a_one_line_error():
    line = one_line_error(zllm("run", "--config", CONFIGS / "stories260k-hf.yaml", "--chat", "--max-new-tokens", "2"))
    assert "model has no chat template" in line and "stories260k" in line


def test_system_without_chat_is_a_one_line_error():
    line = one_line_error(zllm("run", "--config", CONFIGS / "stories260k-hf.yaml", "--system", "x"))
    assert "--system" in line and "--chat" in line
