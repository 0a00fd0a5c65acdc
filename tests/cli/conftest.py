"""Helpers for CLI tests: run the real ``zllm`` console script in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("zllm")
ZLLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "zllm.cli.main"]


def zllm(
    *args: str, env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``zllm ARGS`` and capture its output; ``env`` entries are added to a clean copy
    of the environment (ZLLM_PLUGINS unset unless given)."""
    full_env = {k: v for k, v in os.environ.items() if k != "ZLLM_PLUGINS"}
    full_env.update(env or {})
    return subprocess.run(
        [*ZLLM, *map(str, args)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert the bar for a user error (exit 2, one ``error:`` line, no traceback); return the line."""
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1, shown
    assert lines[0].startswith("error: "), shown
    return lines[0]
