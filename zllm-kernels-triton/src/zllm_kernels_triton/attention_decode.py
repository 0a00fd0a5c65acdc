"""Paged decode attention with GQA: one new query token per sequence.

Dimension legend: ``S`` sequences (= query tokens), ``H`` query heads, ``Hkv`` KV heads,
``G = H // Hkv`` query heads per KV head, ``D`` head dim, ``NB`` cache blocks, ``BS`` block
size, ``MB`` max blocks per sequence, ``L`` a sequence's context length.

Sources: paged KV cache read through a block table (Kwon et al. 2023, vLLM
``paged_attention_v1``); online softmax (Milakov & Gimelshein 2018) in the running-max and
running-sum form of FlashAttention (Dao et al. 2022); GQA (Ainslie et al. 2023): query head
``h`` reads KV head ``h // G``.

One program per (sequence, KV head) computes the ``G`` query heads that share the KV head,
so every key and value is read once per group. It walks the keys ``start .. L - 1`` in steps
of :attr:`Tuning.decode_block_n` tokens, finding each token's block through the block
table; ``start`` is 0, or ``L - window`` for sliding-window attention (the query at
``L - 1`` sees keys ``> L - 1 - window``), so no block-table entry before the window is ever
read (the KV cache may have freed it: -1). Scores, softmax and the output are f32 whatever
the cache dtype; ``exp2`` with ``log2(e)`` folded into the scale.

Attention sinks (gpt-oss, :mod:`zllm.domain.attention_sinks`): a head's sink logit is one more
term of its softmax denominator that attends to nothing, so the online softmax starts from
it — running max ``sink`` (in log2 units) and running sum ``exp2(sink - sink) = 1`` — instead
of ``-inf`` and 0; the keys then update both as usual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.tuning import Tuning

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr,
    qk_scale, window, G, D, BS,
    stride_qs, stride_qh, stride_qd, stride_os, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    n_ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * G + rows
    row_mask = rows < G
    dim_mask = dims < D
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    start = 0
    if SLIDING:
        start = tl.maximum(n_ctx - window, 0)
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634  # log2 units
        l_i = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for j0 in range(start, n_ctx, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        key_mask = keys < n_ctx
        block = tl.load(table + keys // BS, mask=key_mask, other=0).to(tl.int64)
        offs = block * stride_cb + (keys % BS) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # every step holds key j0 < n_ctx, so m_new is finite from the first step on
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :], out,
             mask=row_mask[:, None] & dim_mask[None, :])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    *,
    sinks: torch.Tensor | None = None,
    tuning: Tuning = Tuning(),
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context (keys already in the cache).

    Args:
        q: f32 ``[S, H, D]``, any strides; row ``s`` is the query at position
            ``context_lens[s] - 1`` of sequence ``s``.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` f32/f16/bf16, contiguous, ``H % Hkv == 0``.
        block_tables: int32/int64 ``[S, MB]``, physical blocks of each sequence; entries
            before the window (sliding) or after the context may be -1.
        context_lens: int32/int64 ``[S]`` on the device, each >= 1.
        scale: softmax scale, usually ``D ** -0.5``.
        window: 0 for full causal attention, else the sliding window ``W > 0``: the query
            sees keys ``L - W .. L - 1``.
        sinks: None, or f32 ``[H]`` on the device: each head's sink logit (not scaled).
        tuning: launch parameters.

    Returns:
        f32 ``[S, H, D]``. Raises AssertionError on a shape, dtype or device mismatch.
    """
    n_seq, h, d = q.shape
    _, bs, hkv, d_cache = k_cache.shape
    assert q.dtype == torch.float32 and d_cache == d and h % hkv == 0, (q.shape, q.dtype, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous(), (
        k_cache.shape, v_cache.shape)
    assert block_tables.dim() == 2 and block_tables.shape[0] == n_seq, (block_tables.shape, n_seq)
    assert context_lens.shape == (n_seq,), (context_lens.shape, n_seq)
    assert q.device == k_cache.device == block_tables.device == context_lens.device, (q.device, k_cache.device)
    assert window >= 0, window
    assert sinks is None or (sinks.shape == (h,) and sinks.device == q.device), (None if sinks is None else sinks.shape)
    out = torch.empty((n_seq, h, d), dtype=torch.float32, device=q.device)  # [S, H, D]
    if n_seq == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    g = h // hkv
    _decode_kernel[(n_seq, hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens, q if sinks is None else sinks,
        scale * LOG2E, window, g, d, bs,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        SLIDING=window > 0, HAS_SINKS=sinks is not None, PRECISION=tuning.dot_precision,
        BLOCK_G=max(triton.next_power_of_2(g), tuning.dot_min), BLOCK_D=max(triton.next_power_of_2(d), tuning.dot_min),
        BLOCK_N=tuning.decode_block_n, num_warps=tuning.decode_num_warps, num_stages=tuning.decode_num_stages,
    )
    return out
