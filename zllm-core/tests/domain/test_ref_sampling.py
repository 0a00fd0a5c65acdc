"""Reference sampling: greedy, filters, penalties and seeded draws."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import SamplingRow
from zllm.domain.sampling import sample, sample_row

NO_IDS = torch.empty(0, dtype=torch.int64)


def row(**kw) -> SamplingRow:
    base = dict(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
        frequency_penalty=0.0, prompt_token_ids=NO_IDS, output_token_ids=NO_IDS, generator=None,
    )
    base.update(kw)
    return SamplingRow(**base)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=30, deadline=None)
@given(v=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_greedy_is_argmax_and_top_k_1_is_greedy(v, seed):
    logits = torch.randn(1, v, generator=gen(seed))
    expected = int(logits.argmax())
    assert int(sample(logits, [row(temperature=0.0)])) == expected
    assert int(sample(logits, [row(temperature=0.7, top_k=1, generator=gen(seed))])) == expected


def test_greedy_breaks_ties_at_lowest_index_and_does_not_touch_generator():
    g = gen(3)
    before = g.get_state()
    assert int(sample(torch.tensor([[0.0, 2.0, 2.0, 1.0]]), [row(temperature=0.0, generator=g)])) == 1
    assert torch.equal(g.get_state(), before)


def test_top_p_edges_keep_a_token_and_never_nan():
    logits = torch.randn(2000, generator=gen(0)) * 4
    best = int(logits.argmax())
    for seed in range(20):  # p tiny -> only the most likely token survives
        assert sample_row(logits, row(top_p=1e-9, generator=gen(seed))) == best
    # p = 1.0 is the unfiltered distribution: with flat logits each token appears
    flat = torch.zeros(4)
    seen = {sample_row(flat, row(top_p=1.0, generator=gen(s))) for s in range(200)}
    assert seen == {0, 1, 2, 3}
    # extreme logits (one dominant, the rest -inf-like): no NaN anywhere, a valid token
    spiky = torch.full((10,), -1e30)
    spiky[7] = 50.0
    for p in (1e-9, 0.5, 1.0):
        assert sample_row(spiky, row(top_p=p, temperature=1e-4, generator=gen(1))) == 7


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    for p, allowed in ((0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3})):
        got = {sample_row(logits, row(top_p=p, generator=gen(s))) for s in range(300)}
        assert got == allowed, (p, got)


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0])
    got = {sample_row(logits, row(top_k=2, generator=gen(s))) for s in range(200)}
    assert got == {0, 2}
    got = {sample_row(logits, row(top_k=-1, generator=gen(s))) for s in range(400)}
    assert got == {0, 1, 2, 3, 4}


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    got = {sample_row(probs.log(), row(min_p=0.6, generator=gen(s))) for s in range(300)}
    assert got == {0, 1}  # threshold 0.6 * 0.4 = 0.24 drops 0.2 and 0.1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # positive logit divided: token 1 at 2.0 with penalty 10 -> 0.2, so token 3 (0.4) wins greedy
    logits = torch.tensor([-1.0, 2.0, -0.5, 0.4])
    r = row(temperature=0.0, repetition_penalty=10.0, prompt_token_ids=torch.tensor([1]))
    assert sample_row(logits, r) == 3
    # negative logit multiplied, i.e. made MORE negative (dividing would raise it):
    # token 1 at -0.95 in the output with penalty 1.1 -> -1.045, below token 0 at -1.0
    pair = torch.tensor([-1.0, -0.95])
    assert sample_row(pair, row(temperature=0.0)) == 1
    assert sample_row(pair, row(temperature=0.0, repetition_penalty=1.1, output_token_ids=torch.tensor([1]))) == 0
    # prompt and output tokens both count, repeats do not compound
    r = row(temperature=0.0, repetition_penalty=1.1, prompt_token_ids=torch.tensor([1, 1]),
            output_token_ids=torch.tensor([1, 1]))
    assert sample_row(pair, r) == 0
    assert sample_row(torch.tensor([-1.05, -0.95]), r) == 1  # -0.95 * 1.1 = -1.045 > -1.05: applied once


def test_presence_and_frequency_penalties_follow_openai_math():
    # output has token 0 twice and token 1 once; prompt tokens are not counted
    logits = torch.tensor([5.0, 4.0, 3.2, 0.0])
    out_ids = torch.tensor([0, 1, 0])
    prompt = torch.tensor([2, 2, 2])
    # logit -= presence * (count > 0) + frequency * count
    # presence 1, frequency 0.5: [5 - 1 - 1, 4 - 1 - 0.5, 3.2, 0] = [3, 2.5, 3.2, 0] -> token 2
    r = row(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, output_token_ids=out_ids,
            prompt_token_ids=prompt)
    assert sample_row(logits, r) == 2
    # presence 0, frequency 0.9: [5 - 1.8, 4 - 0.9, 3.2, 0] = [3.2, 3.1, 3.2, 0] -> tie -> lowest index 0
    r = row(temperature=0.0, frequency_penalty=0.9, output_token_ids=out_ids, prompt_token_ids=prompt)
    assert sample_row(logits, r) == 0
    # negative presence rewards seen tokens
    r = row(temperature=0.0, presence_penalty=-10.0, output_token_ids=torch.tensor([3]))
    assert sample_row(logits, r) == 3


@settings(max_examples=25, deadline=None)
@given(
    v=st.integers(2, 64), seed=st.integers(0, 2**16), temperature=st.floats(0.05, 3.0), top_k=st.integers(-1, 10),
    top_p=st.floats(1e-6, 1.0), min_p=st.floats(0.0, 0.9),
)
def test_seeded_draws_are_reproducible_and_valid(v, seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(3, v, generator=gen(seed)) * 3

    def make():
        return [row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=gen(seed + i))
                for i in range(3)]

    a, b = sample(logits, make()), sample(logits, make())
    assert a.dtype == torch.int64 and a.shape == (3,)
    assert torch.equal(a, b)
    assert bool(((a >= 0) & (a < v)).all())
    if 0 < top_k < v:  # the token is among the top-k (ties kept)
        kth = logits.topk(top_k, dim=-1).values[:, -1]
        assert bool((logits.gather(1, a[:, None])[:, 0] >= kth).all())


def test_draw_follows_the_distribution():
    # exponential race == sampling from softmax: frequencies within 4 sigma of p
    logits = torch.tensor([0.0, math.log(2.0), math.log(5.0)])
    p = torch.softmax(logits, 0)
    n = 3000
    draws = torch.tensor([sample_row(logits, row(generator=gen(s))) for s in range(n)])
    counts = torch.bincount(draws, minlength=3).float()
    sigma = (p * (1 - p) / n).sqrt()
    assert bool(((counts / n - p).abs() < 4 * sigma).all()), counts / n
