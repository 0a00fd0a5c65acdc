"""CPU sample kernel returns the reference's tokens for the same generators (exact)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import SamplingRow
from zllm.domain.sampling import sample as ref_sample
from zllm_backend_cpu.kernels.sampling import sample


@st.composite
def row_settings(draw, vocab: int):
    ids = st.lists(st.integers(0, vocab - 1), max_size=12)
    return dict(
        temperature=draw(st.sampled_from([0.0, 0.0, 1.0, 0.7]) | st.floats(0.01, 3.0)),
        top_k=draw(st.sampled_from([0, -1, 1, 5, vocab, vocab + 3]) | st.integers(1, vocab)),
        top_p=draw(st.sampled_from([1.0, 1e-9, 0.9]) | st.floats(1e-6, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3])),
        prompt_token_ids=draw(ids),
        output_token_ids=draw(ids),
    )


def make_rows(settings_list, seeds):
    return [
        SamplingRow(**{**s, "prompt_token_ids": torch.tensor(s["prompt_token_ids"], dtype=torch.int64),
                       "output_token_ids": torch.tensor(s["output_token_ids"], dtype=torch.int64)},
                    generator=torch.Generator().manual_seed(seed))
        for s, seed in zip(settings_list, seeds, strict=True)
    ]


@settings(max_examples=50, deadline=None)
@given(data=st.data(), vocab=st.sampled_from([1, 2, 7, 100, 1000]), n_rows=st.integers(1, 6),
       seed=st.integers(0, 2**20))
def test_sample_kernel_equals_reference(data, vocab, n_rows, seed):
    cfg = [data.draw(row_settings(vocab)) for _ in range(n_rows)]
    seeds = [seed + i for i in range(n_rows)]
    logits = torch.randn(n_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    rows_ref, rows_cpu = make_rows(cfg, seeds), make_rows(cfg, seeds)
    # exact: same tokens, and every generator advanced identically
    assert torch.equal(sample(logits, rows_cpu), ref_sample(logits, rows_ref))
    for a, b in zip(rows_ref, rows_cpu, strict=True):
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_many_seeds_one_config():
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(0))
    cfg = [dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.0,
                frequency_penalty=0.0, prompt_token_ids=[1, 2, 3], output_token_ids=[7])] * 4
    for seed in range(30):
        seeds = [seed * 10 + i for i in range(4)]
        assert torch.equal(sample(logits, make_rows(cfg, seeds)), ref_sample(logits, make_rows(cfg, seeds)))
