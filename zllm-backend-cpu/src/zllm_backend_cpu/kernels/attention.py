"""CPU kernel for causal paged attention (vLLM layout) on top of ``scaled_dot_product_attention``.

Dimension legend: ``T`` tokens in the batch, ``S`` sequences, ``H`` query heads, ``Hkv`` KV
heads, ``D`` head dim, ``NB`` cache blocks, ``BS`` block size, ``Q`` query tokens of a
sequence, ``L`` its context length.

The queries of a sequence are its last ``Q`` context tokens (see ``AttentionMetadata``), so
the causal mask is bottom-right aligned: ``is_causal`` (top-left aligned in SDPA) is used only
when ``Q == L``; decode (``Q == 1``) needs no mask; an append prefill gets an explicit mask.
GQA/MQA: query head ``h`` reads KV head ``h // (H // Hkv)``; decode folds each group of query
heads into the query axis, prefill repeats the KV heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import AttentionMetadata


def write_kv(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> tuple[int, int, int, int]:
    """Check shapes, write the new ``k``/``v`` at ``meta.slot_mapping``; return ``(H, D, BS, Hkv)``."""
    t, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    assert q.dtype == torch.float32 and k.shape == v.shape == (t, hkv, d) and h % hkv == 0, (
        q.shape, k.shape, k_cache.shape
    )
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert sum(meta.query_lens) == t and len(meta.context_lens) == len(meta.query_lens), meta
    k_cache.view(nb * bs, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return h, d, bs, hkv


def window_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, n_q: int, n_ctx: int,
                   window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values one sequence's ``Q`` queries read and which each may attend to:
    ``(ks, vs)`` f32 ``[Hkv, L', D]`` gathered from the first block a query sees (block 0
    when ``window`` is None) to ``n_ctx``, and the causal (and sliding-window) mask bool
    ``[Q, L']``, True = attend. ``block_table`` int ``[max blocks]``; caches ``[NB, BS, Hkv, D]``."""
    bs, hkv, d = k_cache.shape[1:]
    first = 0 if window is None else max(0, n_ctx - n_q - window + 1) // bs  # first block any query reads
    n_blocks = -(-n_ctx // bs)
    blocks = block_table[first:n_blocks]  # [n]
    k0 = first * bs  # absolute position of the first gathered key
    ks = k_cache[blocks].view(-1, hkv, d)[: n_ctx - k0].transpose(0, 1).float()  # [Hkv, L', D]
    vs = v_cache[blocks].view(-1, hkv, d)[: n_ctx - k0].transpose(0, 1).float()  # [Hkv, L', D]
    q_pos = torch.arange(n_ctx - n_q, n_ctx)[:, None]  # [Q, 1]
    k_pos = torch.arange(k0, n_ctx)[None, :]  # [1, L']
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return ks, vs, allowed


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]`` -> f32 ``[T, H, D]``.

    Writes ``k``, ``v`` into the caches at ``meta.slot_mapping`` first (in place).
    """
    h, d, bs, hkv = write_kv(q, k, v, k_cache, v_cache, meta)

    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        n_blocks = -(-n_ctx // bs)
        blocks = meta.block_tables[s, :n_blocks]  # [n_blocks]
        ctx_k = k_cache[blocks].view(n_blocks * bs, hkv, d)[:n_ctx]  # [L, Hkv, D]
        ctx_v = v_cache[blocks].view(n_blocks * bs, hkv, d)[:n_ctx]  # [L, Hkv, D]
        ks = ctx_k.transpose(0, 1).float()  # [Hkv, L, D]
        vs = ctx_v.transpose(0, 1).float()  # [Hkv, L, D]
        if n_q == 1:
            # Decode: fold the G = H / Hkv query heads that share a KV head into the query
            # axis, so SDPA sees MHA over Hkv heads with G queries and no mask. (SDPA's own
            # enable_gqa path measured ~25x slower on CPU for decode-sized inputs.)
            qs = q[start].view(hkv, h // hkv, d)  # [Hkv, G, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=meta.scale)  # [Hkv, G, D]
            out[start] = o.reshape(h, d)
            start += 1
            continue
        qs = q[start : start + n_q].transpose(0, 1)  # [H, Q, D]
        if hkv != h:
            ks = ks.repeat_interleave(h // hkv, dim=0)  # [H, L, D]
            vs = vs.repeat_interleave(h // hkv, dim=0)  # [H, L, D]
        mask = None
        if n_q < n_ctx:
            q_pos = torch.arange(n_ctx - n_q, n_ctx)
            mask = torch.arange(n_ctx)[None, :] <= q_pos[:, None]  # [Q, L], True = attend
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=meta.scale
        )  # [H, Q, D]
        out[start : start + n_q] = o.transpose(0, 1)
        start += n_q
    return out


def attention_sliding(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int,
) -> torch.Tensor:
    """As :func:`attention`, but query ``p`` sees only keys ``p - window + 1 .. p`` (HF
    ``sliding_window_overlay``). Gathers only the blocks from the one holding key
    ``L - Q - window + 1`` on: earlier blocks may already be freed (-1 in the block table).
    """
    assert window > 0, window
    h, d, bs, hkv = write_kv(q, k, v, k_cache, v_cache, meta)

    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        ks, vs, mask = window_context(k_cache, v_cache, meta.block_tables[s], n_q, n_ctx, window)
        if n_q == 1:
            # Decode: fold the query heads of each KV head into the query axis (see attention()).
            qs = q[start].view(hkv, h // hkv, d)  # [Hkv, G, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=meta.scale)  # [Hkv, G, D]
            out[start] = o.reshape(h, d)
            start += 1
            continue
        qs = q[start : start + n_q].transpose(0, 1)  # [H, Q, D]
        if hkv != h:
            ks = ks.repeat_interleave(h // hkv, dim=0)  # [H, L', D]
            vs = vs.repeat_interleave(h // hkv, dim=0)  # [H, L', D]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=meta.scale)  # [H, Q, D]
        out[start : start + n_q] = o.transpose(0, 1)
        start += n_q
    return out
