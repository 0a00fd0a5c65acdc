"""KV-cache write kernel vs the reference ``write_kv``, in the interpreter.

The new keys/values are strided views of a fused QKV output; caches are f32, f16 or bf16
(bf16 inputs made bf16-representable: see ``triton_cases.bf16_representable``).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import CACHE_DTYPES, bf16_representable

from zllm.domain.attention import write_kv as ref_write_kv
from zllm_kernels_triton import Tuning, write_kv


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 9),
    hkv=st.integers(1, 4),
    d=st.sampled_from([8, 16, 32]),
    bs=st.sampled_from([1, 2, 4, 8]),
    cache_dtype=st.sampled_from(CACHE_DTYPES),
    block_h=st.sampled_from([1, 2, 4]),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_write_kv_matches_reference(t, hkv, d, bs, cache_dtype, block_h, slot_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-t // bs) + 2
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    kv = torch.randn(t, 3 * hkv * d, generator=g)
    k, v = kv[:, hkv * d : 2 * hkv * d].view(t, hkv, d), kv[:, 2 * hkv * d :].view(t, hkv, d)
    if cache_dtype == torch.bfloat16:
        bf16_representable(k), bf16_representable(v)
    slots = torch.randperm(n_blocks * bs, generator=g)[:t]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, k_ref, v_ref, slots)
    write_kv(k, v, k_cache, v_cache, slots.to(slot_dtype), tuning=Tuning(kv_write_block_h=block_h))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_f16_cache_write_rounds_to_nearest():
    k = torch.tensor([[[1.0 + 2**-11 + 2**-13, -1.0e-8]]])  # just above a tie; below half the smallest f16 subnormal
    k_cache = torch.zeros(1, 1, 1, 2, dtype=torch.float16)
    write_kv(k, k, k_cache, torch.zeros_like(k_cache), torch.tensor([0]))
    assert k_cache.flatten().tolist() == [1.0 + 2**-10, -0.0]


def test_negative_slot_is_skipped():
    k = torch.ones(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    write_kv(k, 2 * k, k_cache, v_cache, torch.tensor([3, -1]))
    assert k_cache.view(4, 8).sum(dim=1).tolist() == [0, 0, 0, 8]
    assert v_cache.view(4, 8).sum(dim=1).tolist() == [0, 0, 0, 16]
