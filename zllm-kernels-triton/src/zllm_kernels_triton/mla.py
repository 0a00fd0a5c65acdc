"""The op ``mla_attention[paged]``: Multi-head Latent Attention over a paged latent cache.

Dimension legend: ``T`` tokens in the batch, ``S'`` decode rows, ``H`` heads, ``Dn``
``qk_nope_head_dim``, ``Dr`` ``qk_rope_head_dim``, ``Dv`` ``v_head_dim``, ``R``
``kv_lora_rank``, ``W = R + Dr`` one cached latent row, ``NB`` cache blocks, ``BS`` block
size, ``Q`` query tokens of a sequence, ``L`` its context length.

Sources: DeepSeek-V2 (arXiv:2405.04434 §2.1) and the core's reference
``zllm.domain.mla.mla_paged_attention``; the split of the batch follows vLLM's
``MLACommonImpl``: decode rows (``Q == 1``) run the absorbed form, prefill sequences
(``Q > 1``) the expanded one.

- Write: the new latent rows go to ``meta.slot_mapping``, cast to the cache dtype.
- Decode rows, three launches and no per-sequence loop: (1) :func:`head_matmul` moves each
  query into latent space, ``q_latent[s, h] = W_UK[h]^T q_nope[s, h]`` (``W_UK[h]`` rows
  ``h (Dn + Dv) .. h (Dn + Dv) + Dn - 1`` of ``kv_b_proj``, contracted over its rows);
  (2) ``_mla_decode_kernel``, program per (sequence, tile of :attr:`Tuning.mla_block_h`
  heads), walks the block table reading each cached row ``[c_kv | k_pe]`` once for all the
  tile's heads (MQA over one ``W``-wide key), scores
  ``(q_latent · c_kv + q_pe · k_pe) * scale`` with an online softmax in f32 (``exp2``,
  FlashAttention's running max and sum) and accumulates ``sum_j p_j c_kv_j`` ``[H, R]``;
  (3) :func:`head_matmul` takes that sum out through ``W_UV[h]`` (the next ``Dv`` rows).
- Prefill sequences: the expanded form, ``kv_b_proj`` over the ``L`` gathered latent rows
  (:func:`head_matmul`, the weight in its own format) to per-head ``k_nope`` and ``v``, then
  causal SDPA in f32, bottom-right aligned (torch; one call per prefill sequence).

``kv_b_proj`` is read in its stored format (f32/f16/bf16, or Q8_0 bytes decoded per tile by
:func:`~zllm_kernels_triton.weight_tile.load_weight_tile`); the cache may be f32/f16/bf16,
upcast to f32 on load. All score, softmax and output math is f32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from zllm.plugin_api import AttentionMetadata, QuantizedTensor
from zllm_kernels_triton.tuning import Tuning
from zllm_kernels_triton.weight_tile import DENSE_DTYPES, load_weight_tile, weight_operand

LOG2E = 1.4426950408889634

Weight = torch.Tensor | QuantizedTensor


@triton.jit
def _head_matmul_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, head_rows, row0,
    stride_xm, stride_xh, stride_om, stride_oh, stride_wr,
    CONTRACT_ROWS: tl.constexpr, Q8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    w_head = w_ptr + (head * head_rows + row0) * stride_wr  # first weight row of this head
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + head * stride_xh  # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        if CONTRACT_ROWS:
            w = load_weight_tile(w_head + ks.to(tl.int64)[:, None] * stride_wr, cols[None, :],
                                 k_mask[:, None] & col_mask[None, :], Q8)  # [BK, BN]
            acc += tl.dot(x, w, input_precision=PRECISION)
        else:
            w = load_weight_tile(w_head + cols.to(tl.int64)[:, None] * stride_wr, ks[None, :],
                                 col_mask[:, None] & k_mask[None, :], Q8)  # [BN, BK]
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + head * stride_oh + cols[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])


def head_matmul(x: torch.Tensor, weight: Weight, head_rows: int, row0: int, n_out: int, contract_rows: bool, *,
                tuning: Tuning = Tuning()) -> torch.Tensor:
    """Per-head products with row blocks of one weight: ``out[m, h] = x[m, h] @ W_h^T`` or ``x[m, h] @ W_h``.

    Head ``h``'s block ``W_h`` is the weight's rows ``h * head_rows + row0`` onward: ``n_out``
    rows (``contract_rows`` False: ``W_h [n_out, K]``, contracted over its columns) or ``K``
    rows (``contract_rows`` True: ``W_h [K, n_out]``, contracted over its rows).

    Args:
        x: f32 ``[M, H, K]``, last dim contiguous (other strides free).
        weight: 2-D, f32/f16/bf16 or Q8_0, in its stored format.
        head_rows, row0: the row stride between heads and the first row of head 0.
        n_out: output features per head.
        contract_rows: which weight dim ``K`` runs along (see above).
        tuning: launch parameters (``linear_*`` tiles).

    Returns:
        f32 ``[M, H, n_out]``. Raises AssertionError on a shape, dtype or format mismatch.
    """
    m, h, k = x.shape
    w, q8 = weight_operand(weight, "kv_b_proj")
    rows, cols = weight.shape
    assert x.dtype == torch.float32 and x.stride(-1) == 1, (x.dtype, x.stride())
    last_row = (h - 1) * head_rows + row0 + (k if contract_rows else n_out)
    assert last_row <= rows and (n_out if contract_rows else k) == cols, (x.shape, weight.shape, head_rows, row0)
    out = torch.empty((m, h, n_out), dtype=torch.float32, device=x.device)  # [M, H, n_out]
    if out.numel() == 0:
        return out
    block_m = min(tuning.linear_block_m, max(tuning.dot_min, triton.next_power_of_2(m)))
    grid = (triton.cdiv(m, block_m), h, triton.cdiv(n_out, tuning.linear_block_n))
    _head_matmul_kernel[grid](
        x, w, out, m, n_out, k, head_rows, row0,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), w.stride(0),
        CONTRACT_ROWS=contract_rows, Q8=q8, PRECISION=tuning.dot_precision,
        BLOCK_M=block_m, BLOCK_N=tuning.linear_block_n, BLOCK_K=tuning.linear_block_k,
        num_warps=tuning.linear_num_warps, num_stages=tuning.linear_num_stages,
    )
    return out


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, H, R, DR, BS,
    stride_qs, stride_qh, stride_ps, stride_ph, stride_os, stride_oh,
    stride_cb, stride_cs, stride_bt,
    PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < H
    r_dims = tl.arange(0, BLOCK_R)
    p_dims = tl.arange(0, BLOCK_P)
    r_mask = r_dims < R
    p_mask = p_dims < DR
    n_ctx = tl.load(context_lens_ptr + seq)
    q_lat = tl.load(q_lat_ptr + seq * stride_qs + heads[:, None] * stride_qh + r_dims[None, :],
                    mask=head_mask[:, None] & r_mask[None, :], other=0.0)  # [BH, BR]
    q_pe = tl.load(q_pe_ptr + seq * stride_ps + heads[:, None] * stride_ph + p_dims[None, :],
                   mask=head_mask[:, None] & p_mask[None, :], other=0.0)  # [BH, BP]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for j0 in range(0, n_ctx, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        key_mask = keys < n_ctx
        block = tl.load(table + keys // BS, mask=key_mask, other=0).to(tl.int64)
        rows = cache_ptr + block * stride_cb + (keys % BS) * stride_cs  # [BN]: each row's first value
        c_kv = tl.load(rows[:, None] + r_dims[None, :], mask=key_mask[:, None] & r_mask[None, :],
                       other=0.0).to(tl.float32)  # [BN, BR]
        k_pe = tl.load(rows[:, None] + R + p_dims[None, :], mask=key_mask[:, None] & p_mask[None, :],
                       other=0.0).to(tl.float32)  # [BN, BP]
        scores = (tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
                  + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)) * qk_scale  # [BH, BN], log2 units
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # every step holds key j0 < n_ctx, so m_new is finite from the first step on
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c_kv, input_precision=PRECISION)
        m_i = m_new
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + r_dims[None, :], acc / l_i[:, None],
             mask=head_mask[:, None] & r_mask[None, :])


def mla_decode_latent(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                      tuning: Tuning = Tuning()) -> torch.Tensor:
    """Absorbed MLA decode in latent space: ``softmax(scale (q_latent · c_kv + q_pe · k_pe)) · c_kv``.

    Args:
        q_latent: f32 ``[S', H, R]`` (``W_UK^T q_nope`` per head), last dim contiguous.
        q_pe: f32 ``[S', H, Dr]`` (rotated), last dim contiguous.
        latent_cache: ``[NB, BS, R + Dr]`` f32/f16/bf16, contiguous, holding every row the
            queries see (row ``s`` is the query at position ``context_lens[s] - 1``).
        block_tables: int32/int64 ``[S', MB]``; context_lens: int32/int64 ``[S']``, each >= 1.
        scale: softmax scale.
        tuning: launch parameters (``mla_*``).

    Returns:
        f32 ``[S', H, R]``. Raises AssertionError on a shape, dtype or device mismatch.
    """
    n_seq, h, r = q_latent.shape
    _, bs, width = latent_cache.shape
    dr = width - r
    assert q_latent.dtype == q_pe.dtype == torch.float32 and tuple(q_pe.shape) == (n_seq, h, dr), (
        q_latent.shape, q_pe.shape, latent_cache.shape)
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.is_contiguous(), "strides"
    assert latent_cache.dtype in DENSE_DTYPES, latent_cache.dtype
    assert block_tables.dim() == 2 and block_tables.shape[0] == n_seq and context_lens.shape == (n_seq,), (
        block_tables.shape, context_lens.shape, n_seq)
    assert q_latent.device == latent_cache.device == block_tables.device == context_lens.device, "devices"
    out = torch.empty((n_seq, h, r), dtype=torch.float32, device=q_latent.device)  # [S', H, R]
    if n_seq == 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    block_h = min(tuning.mla_block_h, max(tuning.dot_min, triton.next_power_of_2(h)))
    _mla_decode_kernel[(n_seq, triton.cdiv(h, block_h))](
        q_latent, q_pe, latent_cache, out, block_tables, context_lens,
        scale * LOG2E, h, r, dr, bs,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        PRECISION=tuning.dot_precision, BLOCK_H=block_h,
        BLOCK_R=max(triton.next_power_of_2(r), tuning.dot_min), BLOCK_P=max(triton.next_power_of_2(dr), tuning.dot_min),
        BLOCK_N=tuning.mla_block_n, num_warps=tuning.mla_num_warps, num_stages=tuning.mla_num_stages,
    )
    return out


def _context_rows(latent_cache: torch.Tensor, block_table: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """One sequence's ``L`` cached rows, f32 ``[L, W]``."""
    _, bs, width = latent_cache.shape
    n_blocks = -(-n_ctx // bs)
    return latent_cache[block_table[:n_blocks].long()].view(n_blocks * bs, width)[:n_ctx].float()


def _expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv_b_proj: Weight, dv: int,
              scale: float, tuning: Tuning) -> torch.Tensor:
    """Causal MLA of ``Q`` queries, the last of ``rows`` f32 ``[L, W]``, in the expanded form -> f32 ``[Q, H, Dv]``."""
    n_q, h, dn = q_nope.shape
    n_ctx, dr = rows.shape[0], q_pe.shape[2]
    r = rows.shape[1] - dr
    kv = head_matmul(rows[:, None, :r].contiguous(), kv_b_proj, 0, 0, h * (dn + dv), False,
                     tuning=tuning).view(n_ctx, h, dn + dv)  # [L, H, Dn + Dv]
    k = torch.cat([kv[..., :dn], rows[:, None, r:].expand(n_ctx, h, dr)], dim=-1).transpose(0, 1)  # [H, L, Dn + Dr]
    v = kv[..., dn:].transpose(0, 1)  # [H, L, Dv]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Q, Dn + Dr]
    positions = torch.arange(n_ctx, device=rows.device)
    mask = positions[None, :] <= positions[n_ctx - n_q:, None]  # [Q, L], bottom-right causal
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [H, Q, Dv]
    return out.transpose(0, 1)  # [Q, H, Dv]


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, latent_cache: torch.Tensor,
                  kv_b_proj: Weight, meta: AttentionMetadata, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """Causal MLA over the paged latent cache (module doc): decode rows absorbed, prefill expanded.

    Args:
        q_nope: f32 ``[T, H, Dn]``; q_pe: f32 ``[T, H, Dr]`` (rotated); views of one
            projected query allowed (last dim contiguous).
        latent: f32 ``[T, R + Dr]``, the new tokens' rows, written at ``meta.slot_mapping``
            first.
        latent_cache: ``[NB, BS, R + Dr]`` f32/f16/bf16, contiguous (written in place).
        kv_b_proj: ``[H * (Dn + Dv), R]``, f32/f16/bf16 or Q8_0.
        meta: slot mapping, block tables, query and context lengths, softmax scale.
        tuning: launch parameters.

    Returns:
        f32 ``[T, H, Dv]``. Raises AssertionError on inconsistent shapes or metadata.
    """
    t, h, dn = q_nope.shape
    dr = q_pe.shape[2]
    nb, bs, width = latent_cache.shape
    r = width - dr
    rows, cols = kv_b_proj.shape
    assert q_nope.dtype == q_pe.dtype == latent.dtype == torch.float32, (q_nope.dtype, q_pe.dtype, latent.dtype)
    assert tuple(q_pe.shape[:2]) == (t, h) and tuple(latent.shape) == (t, width), (q_pe.shape, latent.shape)
    assert cols == r and rows % h == 0 and rows // h > dn, (kv_b_proj.shape, h, dn, r)
    assert latent_cache.is_contiguous() and latent_cache.dtype in DENSE_DTYPES, latent_cache.dtype
    n_seq = len(meta.query_lens)
    assert len(meta.context_lens) == n_seq and meta.block_tables.shape[0] == n_seq, meta
    assert sum(meta.query_lens) == t, (meta.query_lens, t)
    assert all(0 < n_q <= n_ctx for n_q, n_ctx in zip(meta.query_lens, meta.context_lens, strict=True)), meta
    dv = rows // h - dn
    latent_cache.view(nb * bs, width).index_copy_(0, meta.slot_mapping.long(), latent.to(latent_cache.dtype))
    out = torch.empty((t, h, dv), dtype=torch.float32, device=q_nope.device)  # [T, H, Dv]
    decode_rows, decode_seqs = [], []
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        if n_q == 1:
            decode_rows.append(start)
            decode_seqs.append(s)
        else:
            out[start:start + n_q] = _expanded(
                q_nope[start:start + n_q], q_pe[start:start + n_q],
                _context_rows(latent_cache, meta.block_tables[s], n_ctx), kv_b_proj, dv, meta.scale, tuning)
        start += n_q
    if decode_rows:
        # one small host->device copy of the decode rows' indices and lengths per call
        index = torch.tensor([*decode_rows, *decode_seqs, *(meta.context_lens[s] for s in decode_seqs)],
                             dtype=torch.int64).to(q_nope.device)
        n_dec = len(decode_rows)
        idx, seqs, context_lens = index[:n_dec], index[n_dec:2 * n_dec], index[2 * n_dec:]
        q_latent = head_matmul(q_nope[idx], kv_b_proj, dn + dv, 0, r, True, tuning=tuning)  # [S', H, R]
        latent_out = mla_decode_latent(q_latent, q_pe[idx], latent_cache, meta.block_tables[seqs],
                                       context_lens, meta.scale, tuning=tuning)  # [S', H, R]
        out[idx] = head_matmul(latent_out, kv_b_proj, dn + dv, dn, dv, False, tuning=tuning)  # [S', H, Dv]
    return out
