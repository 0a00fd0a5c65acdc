"""zllm-kernels-torch paged attention (full and sliding window) vs the f32 references.

A batch mixes new prefills, append prefills and decode rows (the decode rows take the
kernel's padded batched path, the others its per-sequence path) over a shuffled block
pool; sliding batches free (-1) every block before the first one the window can reach.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import attention as ref_attention
from zllm.domain.attention import first_window_block, sliding_window_attention
from zllm_kernels_torch.attention import attention, attention_sliding

HEADS = [(2, 2), (4, 2), (6, 3), (4, 1)]  # MHA, GQA, GQA, MQA


@st.composite
def batches(draw, sliding: bool):
    h, hkv = draw(st.sampled_from(HEADS))
    spans = []  # (query_len, context_len) per sequence
    for _ in range(draw(st.integers(1, 5))):
        n_ctx = draw(st.integers(1, 33))
        spans.append((draw(st.sampled_from([1, n_ctx, max(1, n_ctx // 2)])), n_ctx))
    return dict(h=h, hkv=hkv, d=draw(st.sampled_from([4, 16, 64])), bs=draw(st.sampled_from([1, 4, 7, 16])),
                spans=spans,
                window=draw(st.integers(1, 12)) if sliding else None,
                cache_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                seed=draw(st.integers(0, 2**16)))


def build(h, hkv, d, bs, spans, window, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n_ctx // bs) for _, n_ctx in spans]
    pool = torch.randperm(sum(per_seq) + 2, generator=g)  # two spare blocks nobody owns
    tables = torch.full((len(spans), max(per_seq) + 1), -1, dtype=torch.int64)
    slots = []
    for s, ((n_q, n_ctx), n) in enumerate(zip(spans, per_seq, strict=True)):
        tables[s, :n] = pool[sum(per_seq[:s]) : sum(per_seq[:s]) + n]
        new = torch.arange(n_ctx - n_q, n_ctx)
        slots.append(tables[s, new // bs] * bs + new % bs)
        if window is not None:
            tables[s, : first_window_block(n_q, n_ctx, window, bs)] = -1  # freed by the KV cache
    caches = [torch.randn(len(pool), bs, hkv, d, generator=g).to(cache_dtype) for _ in range(2)]
    t = sum(n_q for n_q, _ in spans)
    q = torch.randn(t, h, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    meta = AttentionMetadata(torch.cat(slots), tables, tuple(n for n, _ in spans), tuple(c for _, c in spans), d**-0.5)
    return q, k, v, caches, meta


def check(kernel, reference, case, *window):
    q, k, v, (k_cache, v_cache), meta = build(**case)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = reference(q, k, v, k_ref, v_ref, meta, *window)
    got = kernel(q, k, v, k_cache, v_cache, meta, *window)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the same KV writes
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # SDPA vs explicit softmax: order only


@settings(max_examples=40, deadline=None)
@given(batches(sliding=False))
def test_paged_attention_matches_reference(case):
    check(attention, ref_attention, case)


@settings(max_examples=40, deadline=None)
@given(batches(sliding=True))
def test_sliding_window_attention_matches_reference_with_freed_blocks(case):
    check(attention_sliding, sliding_window_attention, case, case["window"])
