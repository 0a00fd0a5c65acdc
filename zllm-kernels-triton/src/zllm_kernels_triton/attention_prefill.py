"""Causal prefill attention over the paged KV cache, flash-style, for a varlen batch.

Dimension legend: ``T`` query tokens of the batch, ``S`` sequences, ``H`` query heads,
``Hkv`` KV heads, ``G = H // Hkv``, ``D`` head dim, ``NB`` cache blocks, ``BS`` block size,
``MB`` max blocks per sequence; per sequence ``Q`` query tokens and ``L`` context tokens.

Sources: FlashAttention tiling with online softmax (Dao et al. 2022; Milakov & Gimelshein
2018); paged KV cache read through a block table (Kwon et al. 2023, vLLM); GQA (Ainslie et
al. 2023): query head ``h`` reads KV head ``h // G``.

The queries of a sequence are its last ``Q`` context tokens, so query ``i`` sits at
position ``L - Q + i`` and sees keys ``0 .. L - Q + i`` (bottom-right aligned causal mask):
``Q == L`` is a New Prefill, ``Q < L`` an Append Prefill, ``Q == 1`` a decode step (also
handled here, so one launch serves a mixed batch). With a sliding ``window`` ``W`` a query
at ``p`` sees only keys ``> p - W`` (HF ``sliding_window_overlay``).

Program per (query tile of :attr:`Tuning.prefill_block_m` tokens, query head, sequence). A
tile visits only the keys some row of it may see: from its first row's window start (or 0)
to its last row's position, in steps of :attr:`Tuning.prefill_block_n` tokens, each token's
block looked up in the block table. Blocks before the window are never read, so the KV
cache may have freed them (-1). Products are ``tl.dot`` (tiles padded to
:attr:`Tuning.dot_min`), accumulation and softmax f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.attention_decode import LOG2E
from zllm_kernels_triton.tuning import Tuning


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
    query_starts_ptr, query_lens_ptr, context_lens_ptr, sinks_ptr,
    qk_scale, window, G, D, BS,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    n_q = tl.load(query_lens_ptr + seq)
    if tile * BLOCK_M < n_q:
        q_start = tl.load(query_starts_ptr + seq).to(tl.int64)
        n_ctx = tl.load(context_lens_ptr + seq)
        kv_head = head // G
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_mask = rows < n_q
        dim_mask = dims < D
        pos = n_ctx - n_q + rows  # absolute position of each query row
        q = tl.load(q_ptr + (q_start + rows[:, None]) * stride_qt + head * stride_qh + dims[None, :] * stride_qd,
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        end = n_ctx - n_q + tl.minimum(tile * BLOCK_M + BLOCK_M, n_q)  # one past the last row's own key
        start = 0
        if SLIDING:
            start = tl.maximum(n_ctx - n_q + tile * BLOCK_M - window + 1, 0)
        if HAS_SINKS:  # the online softmax starts from the sink (see attention_decode)
            m_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * (tl.load(sinks_ptr + head).to(tl.float32)
                                                                * 1.4426950408889634)
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + seq * stride_bt
        for j0 in range(start, end, BLOCK_N):
            keys = j0 + tl.arange(0, BLOCK_N)
            key_mask = keys < end
            block = tl.load(table + keys // BS, mask=key_mask, other=0).to(tl.int64)
            offs = block * stride_cb + (keys % BS) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            allowed = key_mask[None, :] & (keys[None, :] <= pos[:, None])
            if SLIDING:
                allowed = allowed & (keys[None, :] > pos[:, None] - window)
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # a row whose window starts after this step has seen no key yet: keep it at zero
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows
        tl.store(out_ptr + (q_start + rows[:, None]) * stride_ot + head * stride_oh + dims[None, :], out,
                 mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
    *,
    sinks: torch.Tensor | None = None,
    tuning: Tuning = Tuning(),
) -> torch.Tensor:
    """Causal attention of a varlen batch of queries over its paged context (keys already cached).

    Args:
        q: f32 ``[T, H, D]``, any strides; sequence ``s`` owns rows
            ``query_starts[s] .. query_starts[s] + query_lens[s] - 1``, its last
            ``query_lens[s]`` context tokens.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` f32/f16/bf16, contiguous, ``H % Hkv == 0``.
        block_tables: int32/int64 ``[S, MB]``; entries before a sequence's window (sliding)
            or after its context may be -1.
        query_starts, query_lens, context_lens: int32/int64 ``[S]`` on the device,
            ``1 <= query_lens[s] <= context_lens[s]``.
        max_query_len: ``max(query_lens)`` (sizes the grid; known on the host).
        scale: softmax scale, usually ``D ** -0.5``.
        window: 0 for full causal attention, else the sliding window ``W > 0``.
        sinks: None, or f32 ``[H]`` on the device: each head's sink logit in every softmax
            denominator (not scaled; :mod:`zllm_kernels_triton.attention_decode`).
        tuning: launch parameters.

    Returns:
        f32 ``[T, H, D]`` (rows of no sequence are left uninitialised). Raises
        AssertionError on a shape, dtype or device mismatch.
    """
    t, h, d = q.shape
    _, bs, hkv, d_cache = k_cache.shape
    n_seq = block_tables.shape[0]
    assert q.dtype == torch.float32 and d_cache == d and h % hkv == 0, (q.shape, q.dtype, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous(), (
        k_cache.shape, v_cache.shape)
    assert block_tables.dim() == 2, block_tables.shape
    assert query_starts.shape == query_lens.shape == context_lens.shape == (n_seq,), (
        query_starts.shape, query_lens.shape, context_lens.shape, n_seq)
    assert q.device == k_cache.device == block_tables.device == query_lens.device, (q.device, k_cache.device)
    assert window >= 0, window
    assert sinks is None or (sinks.shape == (h,) and sinks.device == q.device), (None if sinks is None else sinks.shape)
    out = torch.empty((t, h, d), dtype=torch.float32, device=q.device)  # [T, H, D]
    if t == 0 or n_seq == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    block_m = tuning.prefill_block_m
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), h, n_seq)](
        q, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens,
        q if sinks is None else sinks, scale * LOG2E, window, h // hkv, d, bs,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        SLIDING=window > 0, HAS_SINKS=sinks is not None, PRECISION=tuning.dot_precision,
        BLOCK_M=block_m, BLOCK_N=tuning.prefill_block_n, BLOCK_D=max(triton.next_power_of_2(d), tuning.dot_min),
        num_warps=tuning.prefill_num_warps, num_stages=tuning.prefill_num_stages,
    )
    return out
