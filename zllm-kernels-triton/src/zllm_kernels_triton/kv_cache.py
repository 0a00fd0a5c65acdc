"""Write new keys and values into the paged KV cache (vLLM ``reshape_and_cache`` layout).

Dimension legend: ``T`` new tokens, ``Hkv`` KV heads, ``D`` head dim, ``NB`` cache blocks,
``BS`` block size (tokens per block).

The cache is ``[NB, BS, Hkv, D]`` (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"); token ``t`` goes to slot
``slot_mapping[t] = block * BS + offset``. Values are cast to the cache dtype on store
(f32, f16 or bf16). A negative slot is skipped (vLLM's convention for padding tokens).

Program per (token, tile of :attr:`Tuning.kv_write_block_h` KV heads); the head dim is one
tile. ``k`` and ``v`` are read through their strides, so views of a fused QKV output need no
copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.tuning import Tuning

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    HKV, D,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_slot, stride_head,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < HKV) & (dims[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
        dst = slot * stride_slot + heads[:, None] * stride_head + dims[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, tuning: Tuning = Tuning()) -> None:
    """Store ``k``, ``v`` f32 ``[T, Hkv, D]`` (any strides) into the caches ``[NB, BS, Hkv, D]``
    (contiguous, f32/f16/bf16) at ``slot_mapping`` int32/int64 ``[T]``, in place.

    Raises AssertionError on a shape, dtype or device mismatch.
    """
    nb, bs, hkv, d = k_cache.shape
    assert k.shape == v.shape and k.dim() == 3 and tuple(k.shape[1:]) == (hkv, d), (k.shape, v.shape, k_cache.shape)
    assert k.dtype == torch.float32 and v.dtype == torch.float32, (k.dtype, v.dtype)
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype and k_cache.dtype in CACHE_DTYPES, (
        k_cache.shape, v_cache.shape, k_cache.dtype, v_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64), (
        slot_mapping.shape, slot_mapping.dtype)
    assert k.device == k_cache.device == v_cache.device == slot_mapping.device, (k.device, k_cache.device)
    t = k.shape[0]
    if t == 0:
        return
    block_h = min(tuning.kv_write_block_h, triton.next_power_of_2(hkv))
    _write_kv_kernel[(t, triton.cdiv(hkv, block_h))](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        hkv, d,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), num_warps=tuning.kv_write_num_warps,
    )
