"""CPU sliding-window attention kernel vs the f32 reference, and the window's own semantics.

Batches as in test_cpu_attention.py; then every block before the first one the window lets
the batch read is set to -1 in the block table and poisoned (NaN) in the cache, as the KV
cache does when it frees blocks outside the window: neither kernel nor reference may read it.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_attention import build, paged_batch

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import attention as ref_attention
from zllm.domain.attention import first_window_block, sliding_window_attention
from zllm_backend_cpu.kernels.attention import attention_sliding


def drop_outside_window(k_cache, v_cache, meta: AttentionMetadata, window: int) -> AttentionMetadata:
    bs = k_cache.shape[1]
    tables = meta.block_tables.clone()
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        first = first_window_block(n_q, n_ctx, window, bs)
        dead = tables[s, :first]
        k_cache[dead] = float("nan")
        v_cache[dead] = float("nan")
        tables[s, :first] = -1
    return AttentionMetadata(meta.slot_mapping, tables, meta.query_lens, meta.context_lens, meta.scale)


@settings(max_examples=40, deadline=None)
@given(paged_batch(), st.integers(1, 24))
def test_sliding_attention_matches_reference_without_reading_freed_blocks(batch, window):
    q, k, v, k_cache, v_cache, meta = build(*batch)
    meta = drop_outside_window(k_cache, v_cache, meta, window)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = sliding_window_attention(q, k, v, k_ref, v_ref, meta, window)
    got = attention_sliding(q, k, v, k_cache, v_cache, meta, window)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(paged_batch())
def test_window_covering_the_context_equals_full_attention(batch):
    q, k, v, k_cache, v_cache, meta = build(*batch)
    expected = ref_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    got = attention_sliding(q, k, v, k_cache, v_cache, meta, max(meta.context_lens))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_window_one_attends_to_itself_only():
    # Window 1: each query sees only its own key, so the output is its own value.
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    meta = AttentionMetadata(torch.arange(5), torch.tensor([[0, 1]]), (5,), (5,), 8**-0.5)
    out = attention_sliding(q, k, v, k_cache, v_cache, meta, 1)
    torch.testing.assert_close(out, v.expand(5, 2, 8), atol=1e-6, rtol=0)
