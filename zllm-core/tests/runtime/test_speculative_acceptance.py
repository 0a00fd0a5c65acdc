"""Speculative acceptance (Leviathan et al. 2023) keeps the target's distribution exactly.

Each chi-square test draws 100,000 tokens through :func:`verify` with a fixed small
vocabulary, a target ``p`` and a proposal ``q`` — a one-hot guess, a draft distribution, a
guess the target never makes — and compares the counts of the verify step's first token
with ``p``. The critical value is chi-square's at significance 1e-4 for 7 degrees of freedom,
so a correct implementation fails once in ten thousand runs, and the seeds are fixed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.runtime.speculative import Lookahead, NgramProposer, SpecStats, verify

V = 8
DRAWS = 100_000
CHI2_CRITICAL_7DF_1E4 = 29.878  # chi-square inverse CDF at 1 - 1e-4, 7 degrees of freedom
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0])


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"drew a token the target gives probability 0: {counts.tolist()}"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _first_tokens(p: torch.Tensor, propose, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    rows = torch.stack([p, p])  # a proposal of one token: two verify rows
    for _ in range(DRAWS):
        token, q = propose(generator)
        counts[verify(rows, [token], generator, greedy=False, q=q)[0]] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one-hot guess from p", "draft distribution", "always wrong"])
def test_the_first_token_of_a_verify_step_is_distributed_as_the_target(case):
    draft = torch.tensor([0.05, 0.05, 0.30, 0.20, 0.10, 0.10, 0.10, 0.10])
    proposers = {
        # n-gram-like: a token proposed with certainty, here itself drawn from p (q one-hot)
        "one-hot guess from p": lambda g: (int(torch.multinomial(P, 1, generator=g)), None),
        # a draft model: x ~ q, and verify is told q
        "draft distribution": lambda g: (int(torch.multinomial(draft, 1, generator=g)), draft[None]),
        # a proposer whose every guess is a token the target never emits
        "always wrong": lambda g: (7, None),
    }
    counts = _first_tokens(P, proposers[case], seed=1234)
    assert _chi_square(counts, P) < CHI2_CRITICAL_7DF_1E4, counts.tolist()


def test_a_rejected_guess_never_repeats_the_guess_and_a_full_accept_draws_a_bonus():
    g = torch.Generator().manual_seed(0)
    one_hot = torch.zeros(V)
    one_hot[3] = 1.0
    rows = torch.stack([one_hot, P])
    assert verify(rows, [3], g, greedy=False)[0] == 3  # p(3) = 1: always accepted
    out = verify(rows, [3], g, greedy=False)
    assert len(out) == 2 and P[out[1]] > 0  # the bonus comes from the next row
    other = torch.zeros(V)
    other[5] = 1.0
    assert verify(torch.stack([other, P]), [3], g, greedy=False) == [5]  # p(3) = 0: the residual is p itself


@settings(max_examples=200, deadline=None)
@given(argmaxes=st.lists(st.integers(0, V - 1), min_size=2, max_size=9), guesses=st.data())
def test_greedy_verification_keeps_the_prefix_equal_to_the_argmax_then_takes_the_argmax(argmaxes, guesses):
    k = len(argmaxes) - 1
    drafts = guesses.draw(st.lists(st.integers(0, V - 1), min_size=k, max_size=k))
    rows = torch.zeros(k + 1, V)
    rows[torch.arange(k + 1), torch.tensor(argmaxes)] = 1.0
    out = verify(rows, drafts, torch.Generator(), greedy=True)
    accepted = next((i for i, (d, a) in enumerate(zip(drafts, argmaxes, strict=False)) if d != a), k)
    assert out == argmaxes[: accepted + 1]


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match_longest_n_first():
    class Seq:
        def __init__(self, ids):
            self.all_ids = ids

    ngram = NgramProposer(min_n=1, max_n=3)
    # "5 6 7" occurred twice; the latest match is followed by 9 9; "6 7" alone would match later.
    ids = [5, 6, 7, 1, 2, 5, 6, 7, 9, 9, 3, 6, 7, 4, 5, 6, 7]
    assert ngram.propose([Seq(ids)], [3])[0].tokens == [9, 9, 3]
    assert ngram.propose([Seq([1, 2, 3, 4])], [3])[0].tokens == []  # nothing repeats
    assert ngram.propose([Seq(ids)], [0])[0].tokens == []


def test_adaptive_lookahead_falls_to_probes_for_a_failing_proposer_and_recovers():
    look = Lookahead(max_k=4)
    assert look.next_k() == 4
    for _ in range(12):
        look.update(look.next_k() or 1, 0)
    ks = [look.next_k() for _ in range(16)]
    assert ks.count(0) >= 14 and ks.count(1) == 2  # one probe every 8 steps
    for _ in range(12):
        look.update(4, 4)
    assert look.next_k() == 4
    assert Lookahead(max_k=3, adaptive=False).next_k() == 3


def test_spec_stats_count_proposals_and_acceptances_per_position():
    stats = SpecStats()
    stats.record(3, 1)
    stats.record(2, 2)
    assert (stats.steps, stats.proposed, stats.accepted) == (2, [2, 2, 1], [2, 1, 0])
    assert stats.acceptance_rate == pytest.approx(3 / 5)
