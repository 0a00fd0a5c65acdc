"""zllm-kernels-torch sampling returns the reference's tokens for the same seeded generators (exact)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import SamplingRow
from zllm.domain.sampling import sample as ref_sample
from zllm_kernels_torch.sampling import sample


@st.composite
def settings_for(draw, vocab: int) -> dict:
    tokens = st.lists(st.integers(0, vocab - 1), max_size=10)
    return dict(
        temperature=draw(st.sampled_from([0.0, 1.0]) | st.floats(0.05, 2.5)),
        top_k=draw(st.sampled_from([0, -1, 1, vocab]) | st.integers(1, vocab + 2)),
        top_p=draw(st.sampled_from([1.0, 1e-30, 0.8]) | st.floats(1e-4, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.2]) | st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.25, 0.7])),
        presence_penalty=draw(st.sampled_from([0.0, 0.4, -0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.25])),
        prompt_token_ids=draw(tokens), output_token_ids=draw(tokens),
    )


def rows_of(settings_list: list[dict], seed: int) -> list[SamplingRow]:
    return [SamplingRow(**{**s, "prompt_token_ids": torch.tensor(s["prompt_token_ids"], dtype=torch.int64),
                           "output_token_ids": torch.tensor(s["output_token_ids"], dtype=torch.int64)},
                        generator=torch.Generator().manual_seed(seed + i))
            for i, s in enumerate(settings_list)]


@st.composite
def batches(draw) -> tuple[torch.Tensor, list[dict], int]:
    """Logits ``[S, V]``, each row's settings, and the seed of the rows' generators."""
    vocab, seed = draw(st.sampled_from([1, 3, 50, 700])), draw(st.integers(0, 2**20))
    chosen = draw(st.lists(settings_for(vocab), min_size=1, max_size=6))
    return torch.randn(len(chosen), vocab, generator=torch.Generator().manual_seed(seed)) * 4, chosen, seed


@settings(max_examples=60, deadline=None)
@given(batches())
def test_batched_sample_equals_reference_and_advances_generators_alike(batch):
    logits, chosen, seed = batch
    mine, reference = rows_of(chosen, seed), rows_of(chosen, seed)
    assert torch.equal(sample(logits, mine), ref_sample(logits, reference))
    assert all(torch.equal(a.generator.get_state(), b.generator.get_state())
               for a, b in zip(mine, reference, strict=True))


def test_greedy_rows_are_argmax_of_penalised_logits_and_leave_generators_untouched():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 2.9]])
    rows = rows_of([dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                         frequency_penalty=0.0, prompt_token_ids=[], output_token_ids=[]),
                    dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=2.0, presence_penalty=0.0,
                         frequency_penalty=0.0, prompt_token_ids=[0], output_token_ids=[])], seed=0)
    before = [r.generator.get_state() for r in rows]
    assert sample(logits, rows).tolist() == [1, 3]  # ties -> lowest index; 3.0 / 2 < 2.9
    assert all(torch.equal(b, r.generator.get_state()) for b, r in zip(before, rows, strict=True))


def test_no_rows_gives_an_empty_int64_tensor():
    assert sample(torch.empty(0, 5), []).dtype == torch.int64
