"""CPU paged attention kernel vs the f32 reference on random block tables.

Builds S sequences (new prefill, append prefill, decode) whose earlier tokens sit in a paged
cache behind a random block table, runs kernel and reference on identical copies of the
caches, and compares outputs and the caches after the write.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.paged_batches import paged_batch as build
from zllm.domain.attention import attention as ref_attention
from zllm_backend_cpu.kernels.attention import attention

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1)]  # MHA, GQA, GQA, MQA


@st.composite
def paged_batch(draw):
    h, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([8, 16, 64]))
    bs = draw(st.sampled_from([1, 3, 4, 16]))
    lens = []
    for _ in range(draw(st.integers(1, 4))):
        n_ctx = draw(st.integers(1, 40))
        kind = draw(st.sampled_from(["new", "append", "decode"]))
        lens.append(({"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind], n_ctx))
    cache_dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    return h, hkv, d, bs, lens, cache_dtype, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(paged_batch())
def test_attention_matches_reference(batch):
    q, k, v, k_cache, v_cache, meta = build(*batch)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ref_attention(q, k, v, k_ref, v_ref, meta)
    got = attention(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # same writes
    # f32 SDPA vs explicit f32 softmax: summation order only -> 1e-5
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
