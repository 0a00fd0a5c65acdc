"""The per-step shortcut of the decode path gives what the slow path gives: the runner's
all-greedy shortcut picks the runtime sampler's token at every step (the RoPE table's rows are
tested in zllm-core/tests/domain/test_rope_table.py)."""

from __future__ import annotations

import pytest
import torch

import zllm
from tests.conftest import CONFIGS
from zllm.plugin_api import SamplingRow
from zllm.runtime.sampler import Sampler


@pytest.fixture(scope="module")
def engine():
    return zllm.Engine.from_config(CONFIGS / "stories260k-hf.yaml")


def _greedy_row() -> SamplingRow:
    empty = torch.empty(0, dtype=torch.int64)
    return SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, prompt_token_ids=empty, output_token_ids=empty,
                       generator=torch.Generator())


def test_greedy_shortcut_picks_the_runtime_samplers_token_at_every_step(engine) -> None:
    prompt = engine.tokenizer.encode("One day, a little")
    out = engine.generate({"prompt_token_ids": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    ids = prompt + out["token_ids"]
    logits = engine.prompt_logits(ids[:-1])  # [P + N - 1, V]: the logits each generated token came from
    rows = logits[len(prompt) - 1:]  # [N, V]
    sampled = Sampler()(rows, [_greedy_row() for _ in range(rows.shape[0])]).token_ids
    assert sampled.tolist() == out["token_ids"]
