"""Paged attention ops (KV write + decode or varlen prefill kernel) vs the f32 references, in the interpreter.

Batches from ``triton_cases``: up to 3 sequences mixing New Prefill, Append Prefill and
decode over random block tables, GQA ratios 1/2/4, block sizes 1-8, f32/f16/bf16 caches,
q/k/v as strided views of one fused projection, tiles of 4/8/16 (crossing block and tile
boundaries) and the GPU default tiles. Sliding-window batches first free every block before
the window (-1 in the table, NaN in the cache), so reading one would show in the output.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import TUNINGS, build, free_outside_window, paged_batches, small_tuning

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import attention as ref_attention
from zllm.domain.attention import sliding_window_attention as ref_sliding_window_attention
from zllm_kernels_triton import paged_decode_attention, paged_prefill_attention
from zllm_kernels_triton.attention import attention, attention_sliding


def run_both(batch, tuning, window=None):
    """Kernel and reference outputs on identical copies of the caches; checks the cache writes agree."""
    q, k, v, k_cache, v_cache, meta = build(*batch)
    if window is not None:
        meta = free_outside_window(k_cache, v_cache, meta, window)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if window is None:
        expected = ref_attention(q, k, v, k_ref, v_ref, meta)
        got = attention(q, k, v, k_cache, v_cache, meta, tuning=tuning)
    else:
        expected = ref_sliding_window_attention(q, k, v, k_ref, v_ref, meta, window)
        got = attention_sliding(q, k, v, k_cache, v_cache, meta, window, tuning=tuning)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())
    assert got.shape == q.shape and got.dtype == torch.float32
    return got, expected


# Caches of any dtype are read back identically by kernel and reference, and all softmax math
# is f32 in both: the differences are summation order and exp2 vs exp, so 1e-4 throughout.


@settings(max_examples=20, deadline=None)
@given(paged_batches(), TUNINGS)
def test_attention_matches_reference(batch, tuning):
    got, expected = run_both(batch, tuning)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(paged_batches(max_seqs=4, max_ctx=20, decode_only=True), TUNINGS)
def test_decode_batch_matches_reference(batch, tuning):
    got, expected = run_both(batch, tuning)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.booleans().flatmap(lambda decode_only: paged_batches(decode_only=decode_only)), st.integers(1, 14), TUNINGS)
def test_sliding_attention_matches_reference_without_reading_freed_blocks(batch, window, tuning):
    got, expected = run_both(batch, tuning, window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_window_one_attends_to_itself_only():
    # Window 1: each query sees only its own key, so its output is its own value.
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    meta = AttentionMetadata(torch.arange(5), torch.tensor([[0, 1]]), (5,), (5,), 8**-0.5)
    out = attention_sliding(q, k, v, k_cache, v_cache, meta, 1, tuning=small_tuning(4))
    torch.testing.assert_close(out, v.expand(5, 2, 8), atol=1e-6, rtol=0)


def test_raw_kernels_read_int32_metadata_and_agree_on_decode():
    # One decode step of 3 sequences through both raw kernels, block tables and lengths int32.
    batch = (4, 2, 16, 4, [(1, 7), (1, 1), (1, 12)], torch.float16, 5)
    q, k, v, k_cache, v_cache, meta = build(*batch)
    expected = ref_attention(q, k, v, k_cache, v_cache, meta)  # also writes the new k/v
    tables = meta.block_tables.to(torch.int32)
    ctx = torch.tensor(meta.context_lens, dtype=torch.int32)
    tuning = small_tuning(4)
    decode = paged_decode_attention(q, k_cache, v_cache, tables, ctx, meta.scale, tuning=tuning)
    ones = torch.ones(3, dtype=torch.int32)
    prefill = paged_prefill_attention(q, k_cache, v_cache, tables, torch.arange(3, dtype=torch.int32), ones, ctx, 1,
                                      meta.scale, tuning=tuning)
    torch.testing.assert_close(decode, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)
