"""The runner refuses a step whose logits are not finite, and only such a step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zllm.runtime.runner import check_finite_logits


def test_finite_logits_whose_sum_overflows_pass():
    logits = torch.full((2, 8), 3e38)  # each finite, the sum inf in f32
    assert torch.isinf(logits.sum())
    check_finite_logits(logits)


@given(st.integers(1, 4), st.integers(1, 64), st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       st.data())
def test_one_non_finite_value_anywhere_is_refused_naming_the_rows(rows, vocab, bad, data):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    logits[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, vocab - 1))] = bad
    with pytest.raises(RuntimeError, match=f"logits are not finite in 1 of {rows} rows"):
        check_finite_logits(logits)


def test_a_step_without_sampled_rows_passes():
    check_finite_logits(torch.empty(0, 32))
