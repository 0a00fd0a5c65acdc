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


def put_nan_in_weight(checkpoint: Path, suffix: str) -> None:
    """Write NaN into element [0, 0] of the tensor whose name ends with ``suffix`` in the
    checkpoint's (single) safetensors shard, as a corrupted download would carry it."""
    from safetensors.torch import load_file, save_file

    shard = next(checkpoint.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith(suffix))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})


def assert_run_ends_with_one_error(config: Path, phrase: str) -> None:
    """Assert that ``zllm run --config CONFIG`` fails while running as the bar asks of an engine
    failure: exit 3, no traceback, one ``error:`` line that contains ``phrase``."""
    run = subprocess.run(
        [*ZLLM, "run", "--config", str(config), "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and phrase in errors[0], run.stderr


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert the bar for a user error (exit 2, one ``error:`` line, no traceback); return the line."""
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1, shown
    assert lines[0].startswith("error: "), shown
    return lines[0]
