"""A paged-attention batch for kernel tests: the new tokens of each sequence and KV caches
holding the older ones, blocks handed out in random order so a kernel that ignores the block
table reads the wrong keys."""

from __future__ import annotations

import math

import torch

from zllm.capabilities.ops import AttentionMetadata


def paged_batch(h: int, hkv: int, d: int, bs: int, lens: list[tuple[int, int]], cache_dtype: torch.dtype, seed: int,
                *, fused_qkv: bool = False):
    """``(q, k, v, k_cache, v_cache, meta)`` for sequences ``lens = [(query_len, context_len), ...]``.

    ``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]`` (with ``fused_qkv``: strided views
    into one ``[T, (H + 2 Hkv) * D]`` projection, as a model's fused QKV matmul gives them),
    caches ``cache_dtype [NB, BS, Hkv, D]`` filled with random values (one spare block and one
    column of -1 padding in the block table).
    """
    g = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(c / bs) for _, c in lens]
    n_blocks = sum(per_seq) + 2
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int64)
    slots, used = [], 0
    for s, (n_q, n_ctx) in enumerate(lens):
        tables[s, : per_seq[s]] = perm[used : used + per_seq[s]]
        used += per_seq[s]
        pos = torch.arange(n_ctx - n_q, n_ctx)
        slots.append(tables[s, pos // bs] * bs + pos % bs)
    t = sum(q for q, _ in lens)
    if fused_qkv:
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    else:
        q = torch.randn(t, h, d, generator=g)
        k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    meta = AttentionMetadata(torch.cat(slots), tables, tuple(q for q, _ in lens), tuple(c for _, c in lens), d**-0.5)
    return q, k, v, k_cache, v_cache, meta
