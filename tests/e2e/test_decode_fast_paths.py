"""The per-step shortcuts of the decode path give what the slow path gives: the llama model's
RoPE table rows equal ``rope_cos_sin`` at those positions bit for bit (whatever order the table
grew in), and the runner's all-greedy shortcut picks the runtime sampler's token at every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zllm
from tests.conftest import CONFIGS
from zllm.plugin_api import AttentionMetadata, SamplingRow, rope_cos_sin
from zllm.runtime.sampler import Sampler


@pytest.fixture(scope="module")
def engine():
    return zllm.Engine.from_config(CONFIGS / "stories260k-hf.yaml")


def _meta(context_lens: tuple[int, ...]) -> AttentionMetadata:
    # Only context_lens matters to the RoPE table; the rest just has to be well formed.
    return AttentionMetadata(slot_mapping=torch.zeros(len(context_lens), dtype=torch.int64),
                             block_tables=torch.zeros(len(context_lens), 1, dtype=torch.int64),
                             query_lens=(1,) * len(context_lens), context_lens=context_lens, scale=1.0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=6), min_size=1, max_size=4))
def test_rope_table_rows_equal_rope_cos_sin_as_the_table_grows(engine, steps: list[list[int]]) -> None:
    model = engine.llm.runner.model
    model._rope_table = None  # start empty, so every example grows it through its own sizes
    for positions in steps:
        pos = torch.tensor(positions, dtype=torch.int64)
        cos, sin = model.rope_cos_sin_rows(pos, _meta(tuple(p + 1 for p in positions)))
        want_cos, want_sin = rope_cos_sin(pos, model.inv_freq, model.rope_attention_factor)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions
        assert model._rope_table[0].shape[0] <= model.context_length


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
