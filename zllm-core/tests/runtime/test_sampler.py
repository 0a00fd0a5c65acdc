"""The runtime sampler: the reference's tokens for the same seeded generators (exact), logprobs
from the raw distribution, logits masks, the drawn-from distribution, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import SamplingRow
from zllm.domain.sampling import sample as ref_sample
from zllm.runtime.sampler import LOGPROB_FLOOR, Sampler, prompt_logprobs, unpack_bitmask

SAMPLER = Sampler()
INVARIANT = Sampler(batch_invariant=True)


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


def plain(temperature: float = 1.0, seed: int = 0, **kw) -> SamplingRow:
    empty = torch.empty(0, dtype=torch.int64)
    base = dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                prompt_token_ids=empty, output_token_ids=empty)
    return SamplingRow(temperature=temperature, **{**base, **kw}, generator=torch.Generator().manual_seed(seed))


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
    assert torch.equal(SAMPLER(logits, mine).token_ids, ref_sample(logits, reference))
    assert all(torch.equal(a.generator.get_state(), b.generator.get_state())
               for a, b in zip(mine, reference, strict=True))


def test_greedy_rows_are_argmax_of_penalised_logits_and_leave_generators_untouched():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 2.9]])
    rows = [plain(0.0), plain(0.0, repetition_penalty=2.0, prompt_token_ids=torch.tensor([0]))]
    before = [r.generator.get_state() for r in rows]
    assert SAMPLER(logits, rows).token_ids.tolist() == [1, 3]  # ties -> lowest index; 3.0 / 2 < 2.9
    assert all(torch.equal(b, r.generator.get_state()) for b, r in zip(before, rows, strict=True))


def test_no_rows_gives_an_empty_int64_tensor():
    assert SAMPLER(torch.empty(0, 5), []).token_ids.dtype == torch.int64


# ---------------------------------------------------------------------------- logprobs


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 20))
def test_logprobs_are_the_raw_log_softmax_whatever_the_settings(batch, n):
    logits, chosen, seed = batch
    out = SAMPLER(logits, rows_of(chosen, seed), logprobs=True, top_logprobs=min(n, logits.shape[1]))
    expected = torch.log_softmax(logits.double(), dim=-1)  # [S, V], independent f64 computation
    got_chosen = expected.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs.double(), got_chosen, atol=1e-5, rtol=1e-5)
    k = min(n, logits.shape[1])
    assert (out.top_ids is None) if k == 0 else (out.top_ids.shape == (len(chosen), k))
    if k:
        torch.testing.assert_close(out.top_logprobs.double(), expected.gather(1, out.top_ids), atol=1e-5, rtol=1e-5)
        assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())  # most likely first
        assert torch.equal(out.top_ids[:, 0], logits.argmax(dim=-1))


def test_logprobs_of_impossible_tokens_are_floored_and_equal_top_logprobs_keep_ids_ascending():
    logits = torch.tensor([[float("-inf"), 1.0, 1.0, float("-inf")]])
    out = SAMPLER(logits, [plain(0.0)], logprobs=True, top_logprobs=4)
    assert out.top_ids.tolist() == [[1, 2, 0, 3]]
    assert out.top_logprobs[0].tolist() == pytest.approx([math.log(0.5), math.log(0.5), LOGPROB_FLOOR, LOGPROB_FLOOR])
    assert all(math.isfinite(v) for v in out.top_logprobs.flatten().tolist())


def test_top_logprobs_outside_the_limit_is_a_value_error():
    with pytest.raises(ValueError, match=r"top_logprobs must be in \[0, 20\], got 21"):
        SAMPLER(torch.zeros(1, 30), [plain()], top_logprobs=21)


def test_prompt_logprobs_score_each_token_by_the_logits_before_it():
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(5, 11, generator=g), [3, 1, 4, 1, 5]
    entries = prompt_logprobs(logits, ids, 2)
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert [e.token_id for e in entries] == ids[1:]
    assert [e.logprob for e in entries] == pytest.approx([float(expected[i, ids[i + 1]]) for i in range(4)], abs=1e-5)
    assert [[t for t, _ in e.top] for e in entries] == expected[:4].topk(2).indices.tolist()


# ---------------------------------------------------------------------------- logits masks


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_masked_rows_only_draw_allowed_tokens_and_logprobs_stay_raw(batch, mask_seed):
    logits, chosen, seed = batch
    g = torch.Generator().manual_seed(mask_seed)
    vocab = logits.shape[1]
    masks = []
    for s in range(len(chosen)):
        m = torch.rand(vocab, generator=g) < 0.3
        m[int(torch.randint(0, vocab, (1,), generator=g))] = True  # at least one allowed token
        masks.append(m if s % 2 == 0 else None)  # rows with and without a mask in one batch
    out = SAMPLER(logits, rows_of(chosen, seed), masks=masks, logprobs=True)
    unmasked = SAMPLER(logits, rows_of(chosen, seed), logprobs=True)
    for s, m in enumerate(masks):
        if m is not None:
            assert bool(m[out.token_ids[s]]), (s, int(out.token_ids[s]))
        else:
            assert int(out.token_ids[s]) == int(unmasked.token_ids[s])
    raw = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids[:, None])[:, 0].clamp_min(LOGPROB_FLOOR)
    assert torch.equal(out.logprobs, raw)


def test_a_packed_bitmask_selects_what_the_same_bool_mask_selects():
    vocab = 70  # a padded width that is no multiple of 32
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[0, 31, 32, 63, 64, 69]] = True
    words = torch.zeros(3, dtype=torch.int64)
    for t in torch.nonzero(allowed).flatten().tolist():
        words[t // 32] |= 1 << (t % 32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the sign bit
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1))
    by_bool = SAMPLER(logits, [plain(seed=i) for i in range(8)], masks=[allowed] * 8).token_ids
    by_bits = SAMPLER(logits, [plain(seed=i) for i in range(8)], masks=[packed] * 8).token_ids
    assert torch.equal(by_bool, by_bits) and bool(allowed[by_bool].all())


def test_a_greedy_row_takes_the_best_allowed_token():
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]])
    out = SAMPLER(logits, [plain(0.0)], masks=[torch.tensor([False, True, False, True])])
    assert out.token_ids.tolist() == [3]


@pytest.mark.parametrize(("mask", "message"), [
    (torch.ones(5, dtype=torch.bool), r"row 0: a logits mask must be bool \[6\]"),
    (torch.zeros(6, dtype=torch.bool), r"row 0: the logits mask allows no token"),
    (torch.zeros(2, dtype=torch.int32), r"row 0: a logits mask must be bool \[6\] .* or a packed int32 bitmask \[1\]"),
    (torch.ones(6, dtype=torch.float32), r"row 0: a logits mask must be bool \[6\]"),
])
def test_a_bad_mask_is_a_value_error_naming_the_row(mask, message):
    with pytest.raises(ValueError, match=message):
        SAMPLER(torch.zeros(1, 6), [plain()], masks=[mask])


# ---------------------------------------------------------------------------- the drawn-from distribution


@settings(max_examples=30, deadline=None)
@given(batches())
def test_returned_probs_sum_to_one_and_hold_the_sampled_token(batch):
    logits, chosen, seed = batch
    out = SAMPLER(logits, rows_of(chosen, seed), return_probs=True)
    torch.testing.assert_close(out.probs.sum(dim=-1), torch.ones(len(chosen)))
    assert bool((out.probs.gather(1, out.token_ids[:, None]) > 0).all())
    for s, r in enumerate(chosen):
        if r["temperature"] == 0.0:
            assert out.probs[s].tolist().count(1.0) == 1 and float(out.probs[s, out.token_ids[s]]) == 1.0


#: Each token's frequency over DISTRIBUTION_ROWS draws lies within 0.1 of its probability
#: except with probability < 2 V exp(-2 * 1024 * 0.1**2) ~ 2e-8 (Hoeffding).
DISTRIBUTION_ROWS = 1024


def test_drawn_tokens_follow_softmax_of_logits_over_temperature():
    # The top token has probability 0.64: always taking the argmax (1.0), ignoring the
    # temperature (0.42) or multiplying by it (0.29) is off by more than the 0.1 allowed.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0]).repeat(DISTRIBUTION_ROWS, 1)
    tokens = SAMPLER(logits, [plain(0.5, seed=10_000 + i) for i in range(DISTRIBUTION_ROWS)]).token_ids
    freqs = torch.bincount(tokens, minlength=6).double() / DISTRIBUTION_ROWS
    probs = torch.softmax(logits[0].double() / 0.5, dim=-1)
    assert float((freqs - probs).abs().max()) <= 0.1, (freqs.tolist(), probs.tolist())


# ---------------------------------------------------------------------------- batch invariance


@settings(max_examples=30, deadline=None)
@given(batches(), st.data())
def test_batch_invariant_mode_gives_a_row_the_same_bits_in_any_batch(batch, data):
    logits, chosen, seed = batch
    order = data.draw(st.permutations(range(len(chosen))))
    kw = dict(logprobs=True, top_logprobs=min(3, logits.shape[1]), return_probs=True)
    together = INVARIANT(logits, rows_of(chosen, seed), **kw)
    shuffled_rows = rows_of(chosen, seed)
    shuffled = INVARIANT(logits[list(order)], [shuffled_rows[i] for i in order], **kw)
    for pos, s in enumerate(order):
        alone = INVARIANT(logits[s: s + 1], rows_of(chosen, seed)[s: s + 1], **kw)
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "probs"):
            assert torch.equal(getattr(together, name)[s], getattr(alone, name)[0]), name
            assert torch.equal(getattr(shuffled, name)[pos], getattr(alone, name)[0]), name
