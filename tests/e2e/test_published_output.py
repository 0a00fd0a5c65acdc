"""The shipped default model reproduces llama2.c's published greedy output exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

import zllm
from tests.conftest import CONFIGS, REFERENCE_TEXT

PUBLISHED_TOKENS = 182


@pytest.fixture(scope="module", params=["stories260k-hf", "stories260k-gguf-f32", "stories260k-gguf-f16"])
def engine(request):
    return zllm.Engine.from_config(CONFIGS / f"{request.param}.yaml")


def test_greedy_from_bos_reproduces_published_text(engine):
    out = engine.generate({"prompt": "", "max_tokens": PUBLISHED_TOKENS})
    assert out["usage"]["prompt_tokens"] == 1  # <s> alone
    assert out["usage"]["completion_tokens"] == PUBLISHED_TOKENS
    assert out["finish_reason"] == "length"
    assert out["text"] == REFERENCE_TEXT


def test_hf_generation_stops_on_story_separator_token(engine):
    out = engine.generate({"prompt": "", "max_tokens": 400})
    assert out["finish_reason"] == "stop"
    assert 1 not in out["token_ids"] and 2 not in out["token_ids"]
    # README of the model: the HF checkpoint stops on token 1 after 345 output tokens
    assert out["usage"]["completion_tokens"] == 345
    assert out["text"].startswith(REFERENCE_TEXT)


def test_cli_run_streams_published_text_and_stats(repo):
    proc = subprocess.run(
        [sys.executable, "-m", "zllm.cli.main", "run", "--config", str(CONFIGS / "stories260k-hf.yaml"),
         "--max-new-tokens", str(PUBLISHED_TOKENS)],
        capture_output=True, text=True, timeout=120, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == REFERENCE_TEXT + "\n"
    stats = proc.stderr.strip().splitlines()[-1]
    assert "prompt tokens: 1" in stats and f"generated tokens: {PUBLISHED_TOKENS}" in stats
    assert "TTFT:" in stats and "tokens/s" in stats
