"""f32 reference of causal paged attention (vLLM's PagedAttention layout).

Dimension legend: ``T`` tokens in the flattened batch, ``S`` sequences, ``H`` query heads,
``Hkv`` KV heads (``H % Hkv == 0``; MHA ``Hkv == H``, GQA ``1 < Hkv < H``, MQA
``Hkv == 1``), ``D`` head dim, ``NB`` cache blocks, ``BS`` block size, ``MB`` max blocks
per sequence, ``Q`` query tokens of one sequence, ``L`` its context length.

Sources: scaled dot-product attention (Vaswani et al. 2017); paged KV cache with block
tables and slot mapping (Kwon et al. 2023, vLLM); grouped-query attention by repeating KV
heads (Ainslie et al. 2023; HF ``repeat_kv``: query head ``h`` reads KV head
``h // (H // Hkv)``).

The queries of a sequence are the last ``Q`` of its ``L`` context tokens, so query ``i``
sits at absolute position ``L - Q + i`` and may attend to keys ``0 .. L - Q + i``
(bottom-right aligned causal mask). The softmax is written out in f32 rather than calling
``scaled_dot_product_attention`` so that this oracle is independent of the kernels.

Sliding-window attention (Beltagy et al. 2020, "Longformer"; Mistral 7B, Jiang et al.
2023) further limits query ``p`` to the ``W`` most recent keys ``p - W + 1 .. p`` — HF
transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``. Keys older
than the window of a batch's first query are never read, so the KV cache may already have
freed their blocks (block table entry -1): :func:`sliding_window_attention` gathers only the
blocks from :func:`first_window_block` on.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import AttentionMetadata, OpDeclaration


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k``, ``v`` ``[T, Hkv, D]`` into the caches ``[NB, BS, Hkv, D]`` at ``slot_mapping``
    int64 ``[T]`` (in place)."""
    nb, bs, hkv, d = k_cache.shape
    assert k.shape == v.shape and tuple(k.shape[1:]) == (hkv, d), (k.shape, v.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    assert k.shape[0] == 0 or (0 <= int(slot_mapping.min()) and int(slot_mapping.max()) < nb * bs), "slot out of range"
    for t in range(k.shape[0]):
        slot = int(slot_mapping[t])
        block, offset = slot // bs, slot % bs
        k_cache[block, offset] = k[t].to(k_cache.dtype)
        v_cache[block, offset] = v[t].to(v_cache.dtype)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, first_block: int = 0
) -> torch.Tensor:
    """Cached tokens ``first_block * BS .. context_len - 1`` of one sequence as f32 ``[L', Hkv, D]``.

    ``cache`` is ``[NB, BS, Hkv, D]``, ``block_table`` int64 ``[MB]`` (padding -1 after the
    blocks in use, and -1 for blocks a sliding window freed, all before ``first_block``).
    """
    _, bs, hkv, d = cache.shape
    n_blocks = -(-context_len // bs)  # ceil
    assert 0 <= first_block < n_blocks, (first_block, context_len, bs)
    blocks = block_table[first_block:n_blocks]  # [n]
    assert bool((blocks >= 0).all()), ("block table has padding inside the context", block_table, context_len)
    tokens = cache[blocks].reshape(len(blocks) * bs, hkv, d)  # [n * BS, Hkv, D]
    return tokens[: context_len - first_block * bs].float()  # [L', Hkv, D]


def first_window_block(query_len: int, context_len: int, window: int, block_size: int) -> int:
    """The first block a sliding-window batch reads: the one holding key ``L - Q - W + 1``,
    the oldest key the first query (position ``L - Q``) may attend to."""
    return max(0, context_len - query_len - window + 1) // block_size


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             window: int | None = None, first_key_pos: int = 0,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` f32 ``[Q, H, D]`` over ``k``, ``v`` f32 ``[L', Hkv, D]`` whose last ``Q``
    tokens are the queries.

    The keys are absolute positions ``first_key_pos .. first_key_pos + L' - 1``; with
    ``window`` a query at ``p`` sees only keys ``> p - window``. With ``sinks`` f32 ``[H]``
    each head's sink logit joins every row's softmax as one more column that attends to
    nothing (:mod:`zllm.domain.attention_sinks`). Returns f32 ``[Q, H, D]``.
    """
    n_q, h, d = q.shape
    n_k, hkv, _ = k.shape
    assert n_q <= n_k and h % hkv == 0, (q.shape, k.shape)
    assert window is None or window > 0, window
    assert sinks is None or (sinks.shape == (h,) and sinks.dtype == torch.float32), (sinks.shape, sinks.dtype)
    k = k.repeat_interleave(h // hkv, dim=1)  # [L', H, D]
    v = v.repeat_interleave(h // hkv, dim=1)  # [L', H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, L']
    n_ctx = first_key_pos + n_k
    q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)  # absolute position of each query
    k_pos = torch.arange(first_key_pos, n_ctx, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [Q, L']
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    assert bool(allowed.any(dim=-1).all()), ("a query sees no key", first_key_pos, n_k, n_q, window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(h, n_q, 1)], dim=-1)  # [H, Q, L' + 1]
    scores = scores - scores.amax(dim=-1, keepdim=True)  # every row keeps its own key, so the max is finite
    weights = scores.exp()
    weights = weights / weights.sum(dim=-1, keepdim=True)  # [H, Q, L'] (+ the sink's column)
    if sinks is not None:
        weights = weights[..., :-1]  # the sink attends to nothing
    return torch.einsum("hqk,khd->qhd", weights, v)  # [Q, H, D]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal paged attention for a flattened batch; see :class:`AttentionMetadata`.

    ``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]``
    (any float dtype; written in place at ``meta.slot_mapping`` first) -> f32 ``[T, H, D]``.
    """
    return paged_attention(q, k, v, k_cache, v_cache, meta, None)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int,
) -> torch.Tensor:
    """Causal paged attention where each query sees at most the ``window`` most recent keys
    (itself included); otherwise as :func:`attention`. Reads no block before
    :func:`first_window_block`, so those may be freed (-1) in ``meta.block_tables``.
    """
    assert window > 0, window
    return paged_attention(q, k, v, k_cache, v_cache, meta, window)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attention` (``window`` None) or :func:`sliding_window_attention`, each with one sink
    logit per head when ``sinks`` f32 ``[H]`` is given (:func:`causal_softmax_attention`)."""
    t, h, d = q.shape
    assert q.dtype == torch.float32 and k.dtype == torch.float32 and v.dtype == torch.float32
    assert k.shape == v.shape and k.shape[0] == t and k.shape[2] == d and h % k.shape[1] == 0, (q.shape, k.shape)
    assert k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == tuple(k.shape[1:]), (k_cache.shape, k.shape)
    n_seq = len(meta.query_lens)
    assert len(meta.context_lens) == n_seq and meta.block_tables.shape[0] == n_seq, meta
    assert sum(meta.query_lens) == t, (meta.query_lens, t)
    assert all(0 < ql <= cl for ql, cl in zip(meta.query_lens, meta.context_lens, strict=True)), meta

    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    bs = k_cache.shape[1]
    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s in range(n_seq):
        n_q, n_ctx = meta.query_lens[s], meta.context_lens[s]
        first = 0 if window is None else first_window_block(n_q, n_ctx, window, bs)
        ctx_k = gather_context(k_cache, meta.block_tables[s], n_ctx, first)  # [L', Hkv, D]
        ctx_v = gather_context(v_cache, meta.block_tables[s], n_ctx, first)  # [L', Hkv, D]
        out[start : start + n_q] = causal_softmax_attention(
            q[start : start + n_q], ctx_k, ctx_v, meta.scale, window, first * bs, sinks
        )
        start += n_q
    return out


OPS = (
    OpDeclaration(
        name="attention", variants=("paged",), args=("q", "k", "v", "k_cache", "v_cache", "meta"),
        signature="(q f32 [T, H, D], k f32 [T, Hkv, D], v f32 [T, Hkv, D], k_cache [NB, BS, Hkv, D], "
                  "v_cache [NB, BS, Hkv, D], meta AttentionMetadata) -> f32 [T, H, D]; writes k, v at "
                  "meta.slot_mapping first; causal, bottom-right aligned; softmax scale meta.scale",
        reference="zllm.domain.attention:attention", cases="zllm.conformance.cases:attention_cases",
    ),
    OpDeclaration(
        name="attention_sliding", variants=("paged",), args=("q", "k", "v", "k_cache", "v_cache", "meta", "window"),
        signature="(q, k, v, k_cache, v_cache, meta, window int) -> f32 [T, H, D]: as attention, but a query "
                  "at position p sees only keys p - window + 1 .. p; reads no block before the one holding key "
                  "L - Q - window + 1 (-1 in meta.block_tables: the KV cache freed it)",
        reference="zllm.domain.attention:sliding_window_attention",
        cases="zllm.conformance.cases:attention_sliding_cases",
    ),
)
