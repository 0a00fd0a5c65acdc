"""Causal paged attention (vLLM layout) with native decode (:mod:`.native`, ``csrc/attention.c``).

Dimension legend: ``T`` tokens in the batch, ``S`` sequences, ``S'`` decode rows, ``H`` query
heads, ``Hkv`` KV heads, ``G = H / Hkv``, ``D`` head dim, ``NB`` cache blocks, ``BS`` block
size, ``MB`` max blocks per sequence, ``Q`` query tokens of a sequence, ``L`` its context
length, ``W`` the sliding window.

Source: paged KV cache with block tables and slot mapping (Kwon et al. 2023, vLLM); decode
attention reads the K/V blocks where they lie, one work item per (sequence, KV head) taking
its ``G`` query heads together (GQA, Ainslie et al. 2023: query head ``h`` reads KV head
``h // G``). Sliding window as HF's ``sliding_window_overlay``: a decode query at ``L - 1``
sees keys ``L - W .. L - 1``, and no block before the window's first is read (freed, -1).

A call writes the new ``k``/``v`` of every token into the caches natively (converted to the
cache's type exactly as ``Tensor.to``), then runs every decode row in one native call over all
sequences. A sequence of at most :data:`NATIVE_QUERY_ROWS` query tokens (a decode, a
speculative verify step's ``K + 1`` rows, a short prefill chunk) is decode rows: its query
``j`` of ``Q`` is a decode row over the first ``L - Q + 1 + j`` keys, computed exactly as a
one-token decode at that position would be. Longer prefill sequences go to the torch kernels
of :mod:`.attention`, which write their own tokens again (the same values) before attending.
Caches of another dtype, or not contiguous, take the torch kernels for the whole call.

Numerics: f32 throughout; the exp is within 1 ulp, the softmax is the f32 reference's
(``x - max``, exp, ``/ sum``), only the summation orders differ: within ~1e-6 of
:mod:`zllm.domain.attention`. Each decode row is reduced in a fixed order that depends only
on ``D`` and its own ``L`` and ``W`` (``csrc/attention.c``), so its output is bit-identical
whatever else is in the batch and for any thread count (batch-invariant for decode).
"""

from __future__ import annotations

from array import array

import torch

from zllm.plugin_api import AttentionMetadata
from zllm_backend_cpu.kernels import attention as torch_attention
from zllm_backend_cpu.kernels import attention_sinks as torch_sinks
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function

NATIVE_QUERY_ROWS = 16
"""Sequences with up to this many query tokens in a step attend natively, one decode row per
token (the verify rows of speculative decoding); a longer chunk's rows are a batched matmul
in torch, faster than that many decode rows."""

# zllm_kv_write_<c>(k, k_ts, k_hs, v, v_ts, v_hs, slots, T, Hkv, D, k_cache, v_cache, NB * BS, threads)
_WRITE_ARGTYPES = (P, I64, I64, P, I64, I64, P, I64, I64, I64, P, P, I64, INT)
# zllm_paged_decode_attention_<c>(q, q_ts, q_hs, q_rows | NULL, seqs | NULL, ctx_lens, block_tables,
#     bt_rs, MB, k_cache, v_cache, NB, BS, S', H, Hkv, D, window (0: none), sinks | NULL, scale, out, threads)
_DECODE_ARGTYPES = (P, I64, I64, P, P, P, P, I64, I64, P, P, I64, I64, I64, I64, I64, I64, I64, P, F32, P, INT)
_KERNELS = {
    dtype: (function(f"zllm_kv_write_{name}", *_WRITE_ARGTYPES),
            function(f"zllm_paged_decode_attention_{name}", *_DECODE_ARGTYPES))
    for dtype, name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"))
}


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
    return _attention(q, k, v, k_cache, v_cache, meta, 0)


def attention_sliding(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int,
) -> torch.Tensor:
    """As :func:`attention`, but query ``p`` sees only keys ``p - window + 1 .. p``; block-table
    entries before the first block a query of the batch may read are never read (may be -1)."""
    assert window > 0, window
    return _attention(q, k, v, k_cache, v_cache, meta, window)


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
    """Attention with sinks (gpt-oss, :mod:`zllm.domain.attention_sinks`): as :func:`attention`
    (``window`` None) or :func:`attention_sliding`, each head's softmax taking ``sinks[h]``
    (f32 ``[H]``) as one more logit with no value. Decode rows natively (the sink joins the
    softmax's max and, last, its denominator); prefill sequences through :mod:`.attention_sinks`."""
    assert window is None or window > 0, window
    assert sinks.shape == (q.shape[1],), (sinks.shape, q.shape)
    return _attention(q, k, v, k_cache, v_cache, meta, window or 0, sinks.float().contiguous())


def _torch_kernel(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    if sinks is not None:
        return torch_sinks.attention_sinks(q, k, v, k_cache, v_cache, meta, sinks, window or None)
    if window:
        return torch_attention.attention_sliding(q, k, v, k_cache, v_cache, meta, window)
    return torch_attention.attention(q, k, v, k_cache, v_cache, meta)


def _attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    kernels = _KERNELS.get(k_cache.dtype)
    if kernels is None or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return _torch_kernel(q, k, v, k_cache, v_cache, meta, window, sinks)
    write, decode = kernels
    t, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    n_seq = len(meta.query_lens)
    assert q.dtype == k.dtype == v.dtype == torch.float32 and k.shape == v.shape == (t, hkv, d) and h % hkv == 0, (
        q.shape, q.dtype, k.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape and meta.block_tables.shape[0] == n_seq, meta
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    slots, tables = native_indices(meta)
    threads = torch.get_num_threads()
    out = torch.empty(t, h, d)  # [T, H, D]
    if t == 0:
        return out
    write(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(), t, hkv, d,
          k_cache.data_ptr(), v_cache.data_ptr(), nb * bs, threads)
    n, info, prefill = decode_plan(meta, t)
    if n:
        ptr = info.buffer_info()[0]
        if len(meta.query_lens) == t:  # one row per sequence: row r is sequence r; info: the context lengths
            rows = seqs = None
        else:
            rows, seqs, ptr = ptr, ptr + 8 * n, ptr + 16 * n
        decode(q.data_ptr(), q.stride(0), q.stride(1), rows, seqs, ptr, tables.data_ptr(), tables.stride(0),
               tables.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), nb, bs, n, h, hkv, d, window,
               None if sinks is None else sinks.data_ptr(), meta.scale, out.data_ptr(), threads)
    if prefill:
        _prefill(q, k, v, k_cache, v_cache, meta, window, prefill, out, sinks)
    return out


# The plan of the last metadata seen: every layer of a step gets the same AttentionMetadata
# (frozen; its lengths are tuples), so the decode rows are listed once per step. Replaced as
# one tuple, so a reader sees a meta and its own plan even when engines in other threads
# step concurrently.
_last_plan: tuple[AttentionMetadata | None, tuple] = (None, ())


def native_indices(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta``'s slot mapping int64 ``[T]`` and block tables int64 ``[S, MB]`` with unit inner
    stride, as the native kernels index them (copied only when they are not already)."""
    slots, tables = meta.slot_mapping, meta.block_tables
    if slots.dtype != torch.int64 or slots.stride(0) != 1:
        slots = slots.to(torch.int64).contiguous()
    if tables.dtype != torch.int64 or tables.stride(1) != 1:
        tables = tables.to(torch.int64).contiguous()
    return slots, tables


def decode_plan(meta: AttentionMetadata, t: int) -> tuple[int, array, list[int]]:
    """The decode plan of :func:`_plan` for ``meta`` (``T == t`` tokens), computed once per
    step's metadata: every layer's paged decode kernel, GQA or MLA, reads the same one."""
    last = _last_plan  # one read: another thread (another engine) may replace it meanwhile
    return last[1] if last[0] is meta else _plan(meta, t)


def _plan(meta: AttentionMetadata, t: int) -> tuple[int, array, list[int]]:
    """``(S', info, prefill)``: the decode rows' count, ``info`` int64 — the context lengths when
    every sequence has one query row (``S == T``), else ``[3 S']`` q rows, sequences, context
    lengths — and the prefill sequences (more than :data:`NATIVE_QUERY_ROWS` query rows).
    Remembered for ``meta``."""
    global _last_plan
    query_lens, context_lens = meta.query_lens, meta.context_lens
    assert len(context_lens) == len(query_lens) and sum(query_lens) == t, meta
    plan: tuple[int, array, list[int]]
    if len(query_lens) == t:
        plan = (t, array("q", context_lens), [])
    else:
        rows: list[int] = []
        seqs: list[int] = []
        lens: list[int] = []
        prefill: list[int] = []
        start = 0
        for s, n_q in enumerate(query_lens):
            if n_q <= NATIVE_QUERY_ROWS:
                rows += range(start, start + n_q)
                seqs += [s] * n_q
                lens += range(context_lens[s] - n_q + 1, context_lens[s] + 1)
            else:
                prefill.append(s)
            start += n_q
        plan = (len(rows), array("q", rows + seqs + lens), prefill)
    _last_plan = (meta, plan)
    return plan


def _prefill(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int, prefill: list[int], out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """The prefill sequences ``prefill`` through the torch kernel, their rows into ``out``."""
    starts = [0]
    for n_q in meta.query_lens:
        starts.append(starts[-1] + n_q)
    ranges = [(starts[s], starts[s + 1]) for s in prefill]
    idx: slice | torch.Tensor
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):  # one contiguous run of rows
        idx = slice(ranges[0][0], ranges[-1][1])
    else:
        idx = torch.cat([torch.arange(a, b) for a, b in ranges])  # [T_prefill]
    sub = AttentionMetadata(meta.slot_mapping[idx], meta.block_tables[prefill],
                            tuple(meta.query_lens[s] for s in prefill), tuple(meta.context_lens[s] for s in prefill),
                            meta.scale)
    out[idx] = _torch_kernel(q[idx], k[idx], v[idx], k_cache, v_cache, sub, window, sinks)
