"""Device-generic causal paged attention (vLLM layout) by block gather + ``scaled_dot_product_attention``.

Dimension legend: ``T`` tokens in the batch, ``S`` sequences, ``H`` query heads, ``Hkv`` KV
heads, ``G = H // Hkv`` query heads per KV head (GQA; Ainslie et al. 2023), ``D`` head dim,
``NB`` cache blocks, ``BS`` block size, ``Q`` query tokens of a sequence, ``L`` its context
length, ``Lmax`` the longest context among the decode rows.

A sequence's queries are its last ``Q`` context tokens, so the causal mask is bottom-right
aligned (``zllm.domain.attention``). Decode rows (``Q == 1``) of a step are computed
together: their blocks are gathered into one padded ``[S, Lmax]`` key axis and a boolean
mask hides each row's padding — one SDPA call however many sequences decode. Rows with
``Q > 1`` (new and append prefill) run one SDPA call each, with ``is_causal`` when
``Q == L`` and an explicit mask otherwise. Query lengths are host ints, block tables and
positions stay on the device, so no call reads a device value back to the host.

Sliding windows (``attention_sliding``): query ``p`` sees keys ``p - W + 1 .. p``. Prefill
gathers only the blocks from the one holding key ``L - Q - W + 1``; decode gathers whole
rows, where freed blocks (-1) index the cache's last block and are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import AttentionMetadata


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    """``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]`` -> f32 ``[T, H, D]``.

    Writes ``k``, ``v`` into the caches at ``meta.slot_mapping`` first (in place).
    """
    return _paged(q, k, v, k_cache, v_cache, meta, None)


def attention_sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, window: int) -> torch.Tensor:
    """As :func:`attention`, but query ``p`` sees only keys ``p - window + 1 .. p`` (HF ``sliding_window_overlay``)."""
    assert window > 0, window
    return _paged(q, k, v, k_cache, v_cache, meta, window)


def _write_kv(new: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``new`` f32 ``[T, Hkv, D]`` at ``slots`` int64 ``[T]`` of ``cache [NB, BS, Hkv, D]``
    (in place, in its dtype)."""
    assert cache.is_contiguous() and new.shape[1:] == cache.shape[2:], (new.shape, cache.shape)
    cache.flatten(0, 1).index_copy_(0, slots, new.to(cache.dtype))  # slot = block * BS + offset


def _paged(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    assert q.dtype == torch.float32 and k.shape == v.shape and k.shape[0] == q.shape[0] == sum(meta.query_lens), (
        q.shape, k.shape
    )
    assert q.shape[1] % k.shape[1] == 0 and len(meta.context_lens) == len(meta.query_lens), (q.shape, k.shape, meta)
    _write_kv(k, k_cache, meta.slot_mapping)
    _write_kv(v, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)  # [T, H, D]
    decode_rows, decode_seqs, start = [], [], 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        if n_q == 1:
            decode_rows.append(start)
            decode_seqs.append(s)
        else:
            out[start : start + n_q] = _prefill(q[start : start + n_q], k_cache, v_cache, meta.block_tables[s], n_ctx,
                                                meta.scale, window)
        start += n_q
    if decode_seqs:
        rows = torch.tensor(decode_rows, device=q.device)  # [S]
        tables = meta.block_tables[torch.tensor(decode_seqs, device=q.device)]  # [S, MB]
        lens = [meta.context_lens[s] for s in decode_seqs]
        out.index_copy_(0, rows, _decode(q.index_select(0, rows), k_cache, v_cache, tables, lens, meta.scale, window))
    return out


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, n_ctx: int,
             scale: float, window: int | None) -> torch.Tensor:
    """One sequence's ``Q > 1`` queries f32 ``[Q, H, D]`` over its cached context -> f32 ``[Q, H, D]``."""
    n_q, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    first = 0 if window is None else max(0, n_ctx - n_q - window + 1) // bs  # earlier blocks may be freed
    blocks = table[first : -(-n_ctx // bs)]  # [n]
    k0 = first * bs  # absolute position of the first gathered key

    def context(cache: torch.Tensor) -> torch.Tensor:
        kv = cache[blocks].flatten(0, 1)[: n_ctx - k0]  # [L', Hkv, D]
        return kv.transpose(0, 1).float().repeat_interleave(h // hkv, dim=0)  # [H, L', D]

    qs = q.transpose(0, 1)  # [H, Q, D]
    mask = None
    if window is not None or n_q < n_ctx:
        q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)[:, None]  # [Q, 1]
        k_pos = torch.arange(k0, n_ctx, device=q.device)[None, :]  # [1, L']
        mask = k_pos <= q_pos  # [Q, L'], True = attend
        if window is not None:
            mask &= k_pos > q_pos - window
    o = F.scaled_dot_product_attention(qs, context(k_cache), context(v_cache), attn_mask=mask, is_causal=mask is None,
                                       scale=scale)  # [H, Q, D]
    return o.transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: list[int],
            scale: float, window: int | None) -> torch.Tensor:
    """One query per sequence, f32 ``[S, H, D]``, over padded gathered contexts -> f32 ``[S, H, D]``."""
    n_seq, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    l_max = max(lens)
    blocks = tables[:, : -(-l_max // bs)]  # [S, n]; -1 (padding, freed) reads the last block, masked below

    def context(cache: torch.Tensor) -> torch.Tensor:
        kv = cache[blocks].flatten(1, 2)[:, :l_max]  # [S, Lmax, Hkv, D]
        return kv.permute(0, 2, 1, 3).float()  # [S, Hkv, Lmax, D]

    q_pos = torch.tensor(lens, device=q.device)[:, None] - 1  # [S, 1]
    k_pos = torch.arange(l_max, device=q.device)[None, :]  # [1, Lmax]
    mask = k_pos <= q_pos  # [S, Lmax], True = attend
    if window is not None:
        mask &= k_pos > q_pos - window
    qs = q.view(n_seq, hkv, h // hkv, d)  # [S, Hkv, G, D]: the G heads sharing a KV head become its queries
    o = F.scaled_dot_product_attention(qs, context(k_cache), context(v_cache), attn_mask=mask[:, None, None, :],
                                       scale=scale)  # [S, Hkv, G, D]
    return o.reshape(n_seq, h, d)
