"""RopeTable: gathered rows equal ``rope_cos_sin`` at those positions bit for bit, whatever
order the table grew in, and the table never outgrows the model's context."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.rope import RopeParams, RopeTable, rope_cos_sin, rope_inv_freq

MAX_POSITIONS = 512


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, MAX_POSITIONS - 1), min_size=1, max_size=6), min_size=1, max_size=4),
       st.sampled_from([(16, "default"), (64, "yarn")]))
def test_rope_table_rows_equal_rope_cos_sin_as_the_table_grows(steps: list[list[int]], head: tuple[int, str]) -> None:
    head_dim, rope_type = head
    params = (RopeParams(rope_type="default", theta=10000.0, max_position_embeddings=MAX_POSITIONS)
              if rope_type == "default" else
              RopeParams(rope_type="yarn", theta=10000.0, max_position_embeddings=MAX_POSITIONS, factor=4.0,
                         original_max_position_embeddings=128))
    inv_freq, factor = rope_inv_freq(head_dim, params)
    table = RopeTable(inv_freq, factor, MAX_POSITIONS)
    for positions in steps:
        pos = torch.tensor(positions, dtype=torch.int64)
        cos, sin = table.rows(pos, max(positions) + 1)
        want_cos, want_sin = rope_cos_sin(pos, inv_freq, factor)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), positions
        assert max(positions) < table.cached_positions <= MAX_POSITIONS
