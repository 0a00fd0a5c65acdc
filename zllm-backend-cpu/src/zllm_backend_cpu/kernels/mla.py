"""CPU kernels for Multi-head Latent Attention over a paged latent cache (``mla_attention[paged]``).

Dimension legend: ``T`` tokens in the batch, ``S'`` decode rows, ``H`` heads, ``Dn``
``qk_nope_head_dim``, ``Dr`` ``qk_rope_head_dim``, ``Dv`` ``v_head_dim``, ``R``
``kv_lora_rank``, ``W = R + Dr`` one cached latent row, ``NB`` cache blocks, ``BS`` block
size, ``Q`` query tokens of a sequence, ``L`` its context length.

Source: DeepSeek-V2 (arXiv:2405.04434 §2.1) and the core's reference
:func:`zllm.domain.mla.mla_paged_attention`; the choice of form per row follows vLLM's
``MLACommonImpl``: a prefill sequence (``Q > 1``) rebuilds per-head ``k_nope`` and ``v`` from
its latent rows once (``kv_b_proj`` over ``L`` rows) and runs causal SDPA (the expanded form),
while a decode row (``Q == 1``) moves its query into latent space (``q_nope · W_UK``) and
scores the cached rows as they are (the absorbed form), so decode never rebuilds K or V. The
absorbed decode is MQA over one ``W``-wide key per token with ``H`` queries: the latent
query ``[q_nope · W_UK | q_pe]`` against the whole cached row, the weighted sum of the
``R``-wide latent part taken out through ``W_UV``.

Both forms are exact rewrites of one another (equal to f32 rounding, ~1e-6 here). The
kernels read a sequence's blocks through its block table; a 16-bit cache is upcast per
sequence after the gather.

In :func:`mla_attention` a quantized ``kv_b_proj`` is never decoded whole: the expanded form runs it through the
quantized ``linear`` kernel, the absorbed form decodes one head's ``W_UK`` at a time and runs
each head's ``W_UV`` rows as a quantized slice (:func:`_to_latent`, :func:`_from_latent`).
(The DeepSeek family dequantizes it at load instead where a head's rows do not start on a
scale-block boundary, as vLLM does.) :func:`mla_attention_invariant` decodes it whole for
the call, a transient copy.

:func:`mla_attention` is not batch-invariant (a prefill sequence's queries share one SDPA
call whose blocking depends on ``Q``; the absorbed projections of a decode round are one
batched matmul over its rows). :func:`mla_attention_invariant` runs every query token as a
decode row of its own, through matmuls of fixed shape, so each output row is bit-identical
however its sequence was chunked and whatever else is in the batch (as
:mod:`zllm_backend_cpu.kernels.invariant` does for ``attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import AttentionMetadata, QuantizedTensor
from zllm_backend_cpu.kernels.linear import _decode_rows, linear_dense, linear_quant


def _check(
    q_nope, q_pe, latent, latent_cache, kv_b_proj, meta: AttentionMetadata
) -> tuple[int, int, int, int, int]:
    """Check shapes; return ``(H, Dn, Dr, Dv, R)``."""
    t, h, dn = q_nope.shape
    dr = q_pe.shape[2]
    nb, bs, width = latent_cache.shape
    r = width - dr
    rows, cols = kv_b_proj.shape
    assert q_nope.dtype == q_pe.dtype == latent.dtype == torch.float32, (
        q_nope.dtype,
        q_pe.dtype,
        latent.dtype,
    )
    assert tuple(q_pe.shape[:2]) == (t, h) and tuple(latent.shape) == (t, width), (
        q_pe.shape,
        latent.shape,
    )
    assert cols == r and rows % h == 0 and rows // h > dn, (kv_b_proj.shape, h, dn, r)
    assert sum(meta.query_lens) == t and len(meta.context_lens) == len(meta.query_lens), meta
    return h, dn, dr, rows // h - dn, r


def _write(latent: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    nb, bs, width = latent_cache.shape
    latent_cache.view(nb * bs, width).index_copy_(
        0, meta.slot_mapping, latent.to(latent_cache.dtype)
    )


def _context(latent_cache: torch.Tensor, meta: AttentionMetadata, s: int) -> torch.Tensor:
    """Sequence ``s``'s ``L`` cached rows, f32 ``[L, W]``."""
    _, bs, width = latent_cache.shape
    n_ctx = meta.context_lens[s]
    n_blocks = -(-n_ctx // bs)
    blocks = meta.block_tables[s, :n_blocks]  # [n_blocks]
    return latent_cache[blocks].view(n_blocks * bs, width)[:n_ctx].float()  # [L, W]


def _kv_b_f32(
    kv_b_proj: torch.Tensor | QuantizedTensor, h: int, dn: int, dv: int, r: int
) -> torch.Tensor:
    """``kv_b_proj`` as f32 ``[H, Dn + Dv, R]`` (a view for an f32 weight)."""
    w = (
        _decode_rows(kv_b_proj, 0, kv_b_proj.shape[0])
        if isinstance(kv_b_proj, QuantizedTensor)
        else kv_b_proj.float()
    )
    return w.view(h, dn + dv, r)


def _to_latent(
    q_nope: torch.Tensor, kv_b_proj: torch.Tensor | QuantizedTensor, h: int, dn: int, dv: int, r: int
) -> torch.Tensor:
    """``q_nope`` f32 ``[S', H, Dn]`` -> ``q_nope · W_UK`` f32 ``[H, S', R]``.

    A quantized ``kv_b_proj`` stays quantized: one head's ``Dn`` rows at a time are decoded
    into one reused ``[Dn, R]`` buffer, so no f32 copy of the weight is ever made."""
    if not isinstance(kv_b_proj, QuantizedTensor):
        return torch.bmm(q_nope.transpose(0, 1), _kv_b_f32(kv_b_proj, h, dn, dv, r)[:, :dn])
    out = torch.empty(h, q_nope.shape[0], r)  # [H, S', R]
    buf = torch.empty(dn, r)  # one head's W_UK
    for head in range(h):
        start = head * (dn + dv)
        torch.mm(q_nope[:, head], _decode_rows(kv_b_proj, start, start + dn, buf), out=out[head])
    return out


def _from_latent(
    lat: torch.Tensor, kv_b_proj: torch.Tensor | QuantizedTensor, h: int, dn: int, dv: int, r: int
) -> torch.Tensor:
    """The attended latent f32 ``[H, S', R]`` -> ``lat · W_UV^T`` f32 ``[S', H, Dv]``.

    A quantized ``kv_b_proj`` stays quantized: each head's ``Dv`` rows of ``W_UV`` are a
    quantized row slice run through the quantized ``linear`` kernel."""
    if not isinstance(kv_b_proj, QuantizedTensor):
        w_uv = _kv_b_f32(kv_b_proj, h, dn, dv, r)[:, dn:]  # [H, Dv, R]
        return torch.bmm(lat, w_uv.transpose(1, 2)).transpose(0, 1)
    out = torch.empty(lat.shape[1], h, dv)  # [S', H, Dv]
    for head in range(h):
        start = head * (dn + dv) + dn
        out[:, head] = linear_quant(lat[head].contiguous(), kv_b_proj.rows(slice(start, start + dv)), None)
    return out


def _linear(x: torch.Tensor, w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return linear_quant(x, w, None) if isinstance(w, QuantizedTensor) else linear_dense(x, w, None)


def _expanded(
    q_nope, q_pe, rows: torch.Tensor, kv_b_proj, h: int, dn: int, dv: int, r: int, scale: float
) -> torch.Tensor:
    """Causal MLA of ``Q`` queries, the last of ``rows [L, W]``, in the expanded form.

    Returns f32 ``[Q, H, Dv]``."""
    n_q, n_ctx = q_nope.shape[0], rows.shape[0]
    kv = _linear(rows[:, :r].contiguous(), kv_b_proj).view(n_ctx, h, dn + dv)  # [L, H, Dn + Dv]
    k_pe = rows[:, None, r:].expand(
        n_ctx, h, rows.shape[1] - r
    )  # [L, H, Dr]: one rope key for all heads
    k = torch.cat([kv[..., :dn], k_pe], dim=-1).transpose(0, 1)  # [H, L, Dn + Dr]
    v = kv[..., dn:].transpose(0, 1)  # [H, L, Dv]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Q, Dn + Dr]
    mask = None
    if n_q < n_ctx:  # bottom-right aligned: SDPA's is_causal is top-left aligned
        mask = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n_q, n_ctx)[:, None]  # [Q, L]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
    )  # [H, Q, Dv]
    return out.transpose(0, 1)  # [Q, H, Dv]


def _absorbed_row(q_latent: torch.Tensor, rows: torch.Tensor, r: int, scale: float) -> torch.Tensor:
    """One decode query's latent sum: ``q_latent`` f32 ``[H, W]`` (``[q_nope · W_UK | q_pe]``)
    over ``rows [L, W]`` -> f32 ``[H, R]``."""
    return F.scaled_dot_product_attention(
        q_latent[None], rows[None], rows[None, :, :r], scale=scale
    )[0]  # [H, R]


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: torch.Tensor | QuantizedTensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``q_nope`` f32 ``[T, H, Dn]``, ``q_pe`` f32 ``[T, H, Dr]`` (rotated), ``latent`` f32
    ``[T, W]``, ``latent_cache [NB, BS, W]`` (f32/f16/bf16, written at ``meta.slot_mapping``
    first), ``kv_b_proj [H * (Dn + Dv), R]`` (dense or quantized) -> f32 ``[T, H, Dv]``.

    Prefill sequences in the expanded form, decode rows in the absorbed form (module doc).
    """
    h, dn, dr, dv, r = _check(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)
    _write(latent, latent_cache, meta)
    t = q_nope.shape[0]
    out = torch.empty(t, h, dv)  # [T, H, Dv]
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for s, n_q in enumerate(meta.query_lens):
        assert 0 < n_q <= meta.context_lens[s], meta
        if n_q == 1:
            decode_rows.append(start)
            decode_seqs.append(s)
        else:
            rows = _context(latent_cache, meta, s)  # [L, W]
            out[start : start + n_q] = _expanded(
                q_nope[start : start + n_q],
                q_pe[start : start + n_q],
                rows,
                kv_b_proj,
                h,
                dn,
                dv,
                r,
                meta.scale,
            )
        start += n_q
    if decode_rows:
        idx = torch.tensor(decode_rows)
        q_lat = _to_latent(q_nope[idx], kv_b_proj, h, dn, dv, r)  # [H, S', R]
        q_full = torch.cat([q_lat, q_pe[idx].transpose(0, 1)], dim=-1)  # [H, S', W]
        lat_out = torch.stack(
            [
                _absorbed_row(q_full[:, i], _context(latent_cache, meta, s), r, meta.scale)
                for i, s in enumerate(decode_seqs)
            ],
            dim=1,
        )  # [H, S', R]
        out[idx] = _from_latent(lat_out, kv_b_proj, h, dn, dv, r)  # [S', H, Dv]
    return out


def mla_attention_invariant(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: torch.Tensor | QuantizedTensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """As :func:`mla_attention`, batch-invariant: every query token runs the absorbed form on
    its own, over the ``p + 1`` cached rows its position ``p`` may see (module doc)."""
    h, dn, dr, dv, r = _check(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)
    _write(latent, latent_cache, meta)
    kv_b = _kv_b_f32(kv_b_proj, h, dn, dv, r)  # [H, Dn + Dv, R]
    w_uk, w_uv_t = kv_b[:, :dn], kv_b[:, dn:].transpose(1, 2)  # [H, Dn, R], [H, R, Dv]
    out = torch.empty(q_nope.shape[0], h, dv)  # [T, H, Dv]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, meta
        rows = _context(latent_cache, meta, s)  # [L, W]
        for i in range(n_q):
            row = start + i
            q_lat = torch.bmm(q_nope[row][:, None], w_uk)[:, 0]  # [H, R]
            q_full = torch.cat([q_lat, q_pe[row]], dim=-1)  # [H, W]
            lat = _absorbed_row(q_full, rows[: n_ctx - n_q + i + 1], r, meta.scale)  # [H, R]
            out[row] = torch.bmm(lat[:, None], w_uv_t)[:, 0]  # [H, Dv]
        start += n_q
    return out
