"""CPU kernel for causal paged attention with attention sinks (gpt-oss) on top of
``scaled_dot_product_attention``.

Dimension legend as in :mod:`.attention`: ``T`` tokens, ``H`` query heads, ``Hkv`` KV heads,
``G = H / Hkv``, ``D`` head dim, ``BS`` block size, ``Q`` query tokens of a sequence, ``L'``
the keys it reads.

A sink is one logit per head in every softmax denominator (:mod:`zllm.domain.attention_sinks`).
SDPA takes it as one extra key: a zero key (score ``q . 0 * scale = 0``) with a zero value,
whose additive mask entry is the head's sink logit, so its score is exactly ``sinks[h]`` and
its value adds nothing — the softmax over ``L' + 1`` columns is the sink softmax. The causal
and sliding-window masks become ``-inf`` entries of the same additive mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import AttentionMetadata
from zllm_backend_cpu.kernels.attention import window_context, write_kv


def attention_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]``, ``sinks``
    f32 ``[H]``, ``window`` None (full) or > 0 -> f32 ``[T, H, D]``. Writes ``k``, ``v`` into the
    caches at ``meta.slot_mapping`` first; reads no block before the first one a sliding
    window's first query sees."""
    assert window is None or window > 0, window
    h, d, bs, hkv = write_kv(q, k, v, k_cache, v_cache, meta)
    assert sinks.shape == (h,), (sinks.shape, h)
    sinks = sinks.float()
    g = h // hkv
    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        ks, vs, allowed = window_context(k_cache, v_cache, meta.block_tables[s], n_q, n_ctx, window)
        n_k = ks.shape[1]
        ks = F.pad(ks, (0, 0, 0, 1))  # [Hkv, L' + 1, D]: the sink's zero key
        vs = F.pad(vs, (0, 0, 0, 1))  # [Hkv, L' + 1, D]: the sink's zero value
        mask = torch.zeros(n_q, n_k).masked_fill_(~allowed, float("-inf"))  # [Q, L']
        if n_q == 1:
            # Decode: fold the G query heads of each KV head into the query axis (see .attention).
            qs = q[start].view(hkv, g, d)  # [Hkv, G, D]
            bias = torch.cat([mask.expand(h, n_k), sinks[:, None]], dim=1).view(hkv, g, n_k + 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=meta.scale)  # [Hkv, G, D]
            out[start] = o.reshape(h, d)
            start += 1
            continue
        qs = q[start:start + n_q].transpose(0, 1)  # [H, Q, D]
        if g > 1:
            ks = ks.repeat_interleave(g, dim=0)  # [H, L' + 1, D]
            vs = vs.repeat_interleave(g, dim=0)  # [H, L' + 1, D]
        bias = torch.cat([mask.expand(h, n_q, n_k), sinks[:, None, None].expand(h, n_q, 1)], dim=2)  # [H, Q, L'+1]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=meta.scale)  # [H, Q, D]
        out[start:start + n_q] = o.transpose(0, 1)
        start += n_q
    return out


def attention_sinks_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Batch-invariant :func:`attention_sinks` (:mod:`.invariant`): every query token attends on
    its own, as a decode step does, over exactly the keys it sees (no causal mask) plus the
    sink's zero key, so its numbers do not depend on the batch or on how its prompt was split
    into chunks. Arguments as :func:`attention_sinks`."""
    assert window is None or window > 0, window
    h, d, bs, hkv = write_kv(q, k, v, k_cache, v_cache, meta)
    assert sinks.shape == (h,), (sinks.shape, h)
    g = h // hkv
    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        for pos in range(n_ctx - n_q, n_ctx):
            lo = 0 if window is None else max(0, pos - window + 1)  # first key it sees
            first, last = lo // bs, pos // bs
            blocks = meta.block_tables[s, first:last + 1]
            span = slice(lo - first * bs, pos + 1 - first * bs)
            ks = F.pad(k_cache[blocks].view(-1, hkv, d)[span].transpose(0, 1).float(), (0, 0, 0, 1))  # [Hkv, L+1, D]
            vs = F.pad(v_cache[blocks].view(-1, hkv, d)[span].transpose(0, 1).float(), (0, 0, 0, 1))  # [Hkv, L+1, D]
            n_k = pos + 1 - lo
            bias = torch.cat([torch.zeros(h, n_k), sinks.float()[:, None]], dim=1).view(hkv, g, n_k + 1)
            o = F.scaled_dot_product_attention(q[start].view(hkv, g, d), ks, vs, attn_mask=bias,
                                               scale=meta.scale)  # [Hkv, G, D]
            out[start] = o.reshape(h, d)
            start += 1
    return out
