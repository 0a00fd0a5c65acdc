"""``mla_attention[paged]`` kernel (latent write, absorbed decode in three launches, expanded
prefill) vs the f32 reference ``zllm.domain.mla.mla_paged_attention``, in the interpreter.

Inputs: the conformance kit's cases (New/Append Prefill across block edges, decode batches
at and past block boundaries, block sizes 1/5/16, f16/bf16 latent caches, ``kv_b_proj`` in
f32/bf16/Q8_0, ``q_nope``/``q_pe`` as views of one query projection) and hypothesis-drawn
decode batches whose cache blocks outside every block table hold NaN, so a stray read shows.
A cache of any dtype is read back identically by kernel and reference and the math is f32:
1e-4.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import CACHE_DTYPES, small_tuning

from zllm.conformance.cases import cases_for, make_weight
from zllm.domain.mla import mla_paged_attention
from zllm.plugin_api import AttentionMetadata
from zllm_kernels_triton.mla import mla_attention
from zllm_kernels_triton.tuning import Tuning

CASES = cases_for("mla_attention", "paged", seed=0)


def run_both(args, tuning):
    """Kernel and reference outputs on copies of the latent cache; checks the cache writes agree."""
    q_nope, q_pe, latent, cache, kv_b, meta = args
    ref_cache = cache.clone()
    expected = mla_paged_attention(q_nope, q_pe, latent, ref_cache, kv_b, meta)
    got_cache = cache.clone()
    got = mla_attention(q_nope, q_pe, latent, got_cache, kv_b, meta, tuning=tuning)
    assert torch.equal(got_cache.nan_to_num(), ref_cache.nan_to_num())
    assert got.dtype == torch.float32 and got.shape == expected.shape
    return got, expected


@pytest.mark.parametrize("case", CASES, ids=[c.label.split(" ")[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_mla_matches_reference_on_the_conformance_cases(case):
    got, expected = run_both(case.args, small_tuning(4, mla_block_h=2, mla_block_n=4))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_mla_default_tuning_on_a_mixed_batch_with_a_q8_0_kv_b_proj():
    got, expected = run_both(CASES[2].args, Tuning())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@st.composite
def decode_batches(draw):
    h = draw(st.integers(1, 5))
    dn, dr, dv = (draw(st.sampled_from(v)) for v in ([4, 8, 12], [2, 4, 8], [4, 8, 12]))
    fmt = draw(st.sampled_from(["f32", "f16", "q8_0"]))
    r = 32 if fmt == "q8_0" else draw(st.sampled_from([8, 12, 16]))
    bs = draw(st.sampled_from([1, 3, 4, 8]))
    ctx = draw(st.lists(st.integers(1, 19), min_size=1, max_size=4))
    return dict(h=h, dn=dn, dr=dr, dv=dv, r=r, bs=bs, ctx=ctx, fmt=fmt, cache_dtype=draw(st.sampled_from(CACHE_DTYPES)),
                block_h=draw(st.sampled_from([1, 2, 4, 16])), block_n=draw(st.sampled_from([2, 4, 8, 32])),
                seed=draw(st.integers(0, 2**16)))


def decode_batch(s):
    """A decode round: one new token per sequence, its earlier rows behind a shuffled block
    table; spare blocks hold NaN."""
    g = torch.Generator().manual_seed(s["seed"])
    h, dn, dr, dv, r, bs = s["h"], s["dn"], s["dr"], s["dv"], s["r"], s["bs"]
    n_blocks = [-(-c // bs) for c in s["ctx"]]
    num_blocks = sum(n_blocks) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(s["ctx"]), max(n_blocks) + 1), -1, dtype=torch.int64)
    slots = []
    cache = torch.full((num_blocks, bs, r + dr), float("nan"))
    for i, c in enumerate(s["ctx"]):
        blocks = [order.pop() for _ in range(n_blocks[i])]
        table[i, :n_blocks[i]] = torch.tensor(blocks)
        cache[blocks] = torch.randn(len(blocks), bs, r + dr, generator=g)
        slots.append(blocks[(c - 1) // bs] * bs + (c - 1) % bs)
    cache = cache.to(s["cache_dtype"])
    t = len(s["ctx"])
    q_nope, q_pe = torch.randn(t, h * (dn + dr), generator=g).view(t, h, dn + dr).split([dn, dr], dim=-1)
    latent = torch.randn(t, r + dr, generator=g).to(s["cache_dtype"]).float()
    kv_b = make_weight(g, s["fmt"], h * (dn + dv), r)
    meta = AttentionMetadata(torch.tensor(slots), table, (1,) * t, tuple(s["ctx"]), (dn + dr) ** -0.5)
    return q_nope, q_pe, latent, cache, kv_b, meta


@settings(max_examples=12, deadline=None)
@given(decode_batches())
def test_mla_decode_matches_reference_without_reading_other_blocks(s):
    got, expected = run_both(decode_batch(s), small_tuning(4, mla_block_h=s["block_h"], mla_block_n=s["block_n"]))
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_single_cached_row_decode_returns_that_rows_value():
    # T=1 decode at position 0: softmax over one row is 1, so out = W_UV · c_kv of the new row.
    s = dict(h=2, dn=4, dr=2, dv=4, r=8, bs=4, ctx=[1], fmt="f32", cache_dtype=torch.float32, seed=7)
    q_nope, q_pe, latent, cache, kv_b, meta = decode_batch(s)
    got = mla_attention(q_nope, q_pe, latent, cache, kv_b, meta, tuning=small_tuning(4))
    w_uv = kv_b.view(2, 8, 8)[:, 4:]  # [H, Dv, R]
    torch.testing.assert_close(got[0], w_uv @ latent[0, :8], atol=1e-5, rtol=1e-5)
