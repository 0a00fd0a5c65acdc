"""Reference paged attention vs a naive loop and vs torch SDPA on the contiguous sequences.

Each example builds S sequences with full contiguous K/V histories, scatters the first
``L - Q`` tokens of each into a paged cache through a random block table, then runs the
reference on the last ``Q`` tokens (new prefill ``Q == L``, append prefill ``Q < L``,
decode ``Q == 1``) and checks the output and that the new K/V landed in the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import attention

HEADS = [(4, 4), (4, 2), (6, 2), (4, 1)]  # (H, Hkv): MHA, GQA, GQA, MQA


@st.composite
def paged_batch(draw):
    h, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([4, 8, 16]))
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n_seq = draw(st.integers(1, 3))
    lens = []
    for _ in range(n_seq):
        n_ctx = draw(st.integers(1, 19))
        kind = draw(st.sampled_from(["new", "append", "decode"]))
        n_q = {"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind]
        lens.append((n_q, n_ctx))
    seed = draw(st.integers(0, 2**16))
    return h, hkv, d, bs, lens, seed


def build(h, hkv, d, bs, lens, seed):
    """Caches holding the old tokens, the new q/k/v, metadata, and each sequence's full K/V history."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n_ctx / bs) for _, n_ctx in lens]
    n_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody owns
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=g)  # garbage outside the sequences
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(n_blocks, generator=g)
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int64)
    histories, q_parts, k_parts, v_parts, slots = [], [], [], [], []
    used = 0
    for s, (n_q, n_ctx) in enumerate(lens):
        table = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(table)] = table
        k_all, v_all = torch.randn(n_ctx, hkv, d, generator=g), torch.randn(n_ctx, hkv, d, generator=g)
        q_new = torch.randn(n_q, h, d, generator=g)
        pos = torch.arange(n_ctx)
        slot = table[pos // bs] * bs + pos % bs  # [L]
        old = slot[: n_ctx - n_q]
        k_cache.view(-1, hkv, d)[old] = k_all[: n_ctx - n_q]
        v_cache.view(-1, hkv, d)[old] = v_all[: n_ctx - n_q]
        histories.append((q_new, k_all, v_all))
        q_parts.append(q_new), k_parts.append(k_all[n_ctx - n_q :]), v_parts.append(v_all[n_ctx - n_q :])
        slots.append(slot[n_ctx - n_q :])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), block_tables=tables,
        query_lens=tuple(q for q, _ in lens), context_lens=tuple(c for _, c in lens), scale=d**-0.5,
    )
    return torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), k_cache, v_cache, meta, histories


def naive_attention(q_new, k_all, v_all, scale):
    """Loop over queries and heads; query i sits at position L - Q + i and sees keys 0..that position."""
    n_q, h, _ = q_new.shape
    n_ctx, hkv, _ = k_all.shape
    out = torch.zeros_like(q_new)
    for i in range(n_q):
        pos = n_ctx - n_q + i
        for head in range(h):
            kv = head // (h // hkv)
            scores = torch.stack([q_new[i, head] @ k_all[j, kv] * scale for j in range(pos + 1)])
            w = torch.exp(scores - scores.max())
            w = w / w.sum()
            out[i, head] = sum(w[j] * v_all[j, kv] for j in range(pos + 1))
    return out


def sdpa_attention(q_new, k_all, v_all, scale):
    n_q, h, _ = q_new.shape
    n_ctx, hkv, _ = k_all.shape
    mask = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n_q, n_ctx)[:, None]  # bottom-right causal
    rep = h // hkv
    o = F.scaled_dot_product_attention(
        q_new.transpose(0, 1),
        k_all.repeat_interleave(rep, 1).transpose(0, 1),
        v_all.repeat_interleave(rep, 1).transpose(0, 1),
        attn_mask=mask, scale=scale,
    )
    return o.transpose(0, 1)


@settings(max_examples=30, deadline=None)
@given(paged_batch())
def test_reference_attention_matches_naive_and_sdpa(batch):
    q, k, v, k_cache, v_cache, meta, histories = build(*batch)
    out = attention(q, k, v, k_cache, v_cache, meta)
    assert out.shape == q.shape and out.dtype == torch.float32
    # new K/V written at their slots
    assert torch.equal(k_cache.view(-1, *k.shape[1:])[meta.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, *v.shape[1:])[meta.slot_mapping], v)
    start = 0
    for (q_new, k_all, v_all), n_q in zip(histories, meta.query_lens, strict=True):
        got = out[start : start + n_q]
        start += n_q
        # f32 throughout; differences are summation order only -> 1e-5
        torch.testing.assert_close(got, naive_attention(q_new, k_all, v_all, meta.scale), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, sdpa_attention(q_new, k_all, v_all, meta.scale), atol=1e-5, rtol=1e-5)


def test_f16_cache_is_written_and_read_back():
    q, k, v, _, _, meta, histories = build(4, 2, 8, 4, [(3, 9)], seed=1)
    n_blocks = int(meta.block_tables.max()) + 1
    k_cache = torch.zeros(n_blocks, 4, 2, 8, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    # context fully new here: a new prefill of 9 tokens through the f16 cache
    q_new, k_all, v_all = histories[0]
    pos = torch.arange(9)
    table = meta.block_tables[0]
    meta9 = AttentionMetadata(table[pos // 4] * 4 + pos % 4, meta.block_tables, (9,), (9,), meta.scale)
    q9 = torch.randn(9, 4, 8)
    out = attention(q9, k_all, v_all, k_cache, v_cache, meta9)
    expected = sdpa_attention(q9, k_all.half().float(), v_all.half().float(), meta.scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
