"""The ops ``attention[paged]``, ``attention_sliding[paged]`` and ``attention_sinks[paged]``: KV-cache
write, then one attention launch.

Dimension legend: ``T`` tokens in the batch, ``S`` sequences, ``H`` query heads, ``Hkv`` KV
heads, ``D`` head dim, ``NB`` cache blocks, ``BS`` block size.

Semantics are those of ``zllm.plugin_api.AttentionMetadata`` (the f32 reference is
``zllm.domain.attention``): the new ``k``/``v`` are written at ``meta.slot_mapping``, then
each sequence's queries (its last ``Q`` of ``L`` context tokens) attend causally to its
cached context. A batch of decode steps only (every ``Q == 1``) runs
:func:`~zllm_kernels_triton.attention_decode.paged_decode_attention`; any other batch —
prefills, appends and decodes mixed — runs one varlen
:func:`~zllm_kernels_triton.attention_prefill.paged_prefill_attention`. Per call the host
builds one small int32 tensor (query starts, query lengths, context lengths) and copies it
to the device once; there is no per-sequence launch.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from zllm.plugin_api import AttentionMetadata
from zllm_kernels_triton.attention_decode import paged_decode_attention
from zllm_kernels_triton.attention_prefill import paged_prefill_attention
from zllm_kernels_triton.kv_cache import write_kv
from zllm_kernels_triton.tuning import Tuning


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """Causal paged attention: ``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]`` (any
    strides), caches ``[NB, BS, Hkv, D]`` f32/f16/bf16 (written in place first) -> f32 ``[T, H, D]``.

    Raises AssertionError on inconsistent shapes or metadata.
    """
    return _paged_attention(q, k, v, k_cache, v_cache, meta, 0, tuning)


def attention_sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, window: int, *,
                      tuning: Tuning = Tuning()) -> torch.Tensor:
    """As :func:`attention`, but a query at position ``p`` sees only keys ``p - window + 1 .. p``.

    Blocks before the one holding key ``L - Q - window + 1`` are never read, so they may be
    freed (-1 in ``meta.block_tables``). Raises AssertionError when ``window < 1``.
    """
    assert window > 0, window
    return _paged_attention(q, k, v, k_cache, v_cache, meta, window, tuning)


def attention_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, sinks: torch.Tensor, window: int | None = None, *,
                    tuning: Tuning = Tuning()) -> torch.Tensor:
    """As :func:`attention` (``window`` None) or :func:`attention_sliding` (``window`` > 0), with
    ``exp(sinks[h])`` in every softmax denominator of head ``h``; ``sinks`` f32 ``[H]`` (gpt-oss)."""
    assert window is None or window > 0, window
    return _paged_attention(q, k, v, k_cache, v_cache, meta, window or 0, tuning, sinks.float())


def _paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int, tuning: Tuning,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    t, h, d = q.shape
    n_seq = len(meta.query_lens)
    assert q.dtype == torch.float32 and k.shape == v.shape and k.shape[0] == t and k.shape[2] == d, (q.shape, k.shape)
    assert len(meta.context_lens) == n_seq and meta.block_tables.shape[0] == n_seq, meta
    assert sum(meta.query_lens) == t, (meta.query_lens, t)
    assert all(0 < n_q <= n_ctx for n_q, n_ctx in zip(meta.query_lens, meta.context_lens, strict=True)), meta
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, tuning=tuning)
    if t == 0:
        return torch.empty((0, h, d), dtype=torch.float32, device=q.device)
    max_q = max(meta.query_lens)
    if max_q == 1:
        context_lens = torch.tensor(meta.context_lens, dtype=torch.int32).to(q.device)  # [S]
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, context_lens, meta.scale, window,
                                      sinks=sinks, tuning=tuning)
    starts = [0, *accumulate(meta.query_lens)][:-1]
    lens = torch.tensor([*starts, *meta.query_lens, *meta.context_lens], dtype=torch.int32).to(q.device)  # [3 * S]
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, lens[:n_seq], lens[n_seq : 2 * n_seq],
                                   lens[2 * n_seq :], max_q, meta.scale, window, sinks=sinks, tuning=tuning)
