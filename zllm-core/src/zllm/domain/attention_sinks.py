"""f32 reference of causal paged attention with attention sinks (gpt-oss).

Dimension legend as in :mod:`zllm.domain.attention`: ``T`` tokens in the flattened batch,
``S`` sequences, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``NB`` cache blocks,
``BS`` block size, ``Q`` query tokens of one sequence, ``L'`` the keys it reads.

An attention sink is one learned logit per head that joins every query's softmax
denominator and attends to nothing (Xiao et al. 2023, "Efficient Streaming Language Models
with Attention Sinks", arXiv:2309.17453; OpenAI's gpt-oss model card, 2025, §2.1; HF
transformers 5.24 ``modeling_gpt_oss.eager_attention_forward``): for query ``i`` of head
``h`` with scaled, masked scores ``s_ij``,

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij'))

so the weights of a row sum to less than one: a head may put its mass on the sink and
contribute little. transformers appends the sink as an extra column of the score matrix,
subtracts the row max over all columns (the sink included), takes the softmax and drops the
sink's column; this reference does the same in f32. The sink logits are not scaled by
``meta.scale``. Everything else — the paged cache, the bottom-right causal mask, the
optional sliding window that reads no freed block — is :func:`zllm.domain.attention.attention`'s.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import AttentionMetadata, OpDeclaration
from zllm.domain.attention import first_window_block, gather_context, write_kv


def sink_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                           window: int | None = None, first_key_pos: int = 0) -> torch.Tensor:
    """Attention of ``q`` f32 ``[Q, H, D]`` over ``k``, ``v`` f32 ``[L', Hkv, D]`` (keys at absolute
    positions ``first_key_pos ..``; the last ``Q`` keys are the queries) with one sink logit
    per head, ``sinks`` f32 ``[H]``; with ``window`` a query at ``p`` sees only keys
    ``> p - window``. Returns f32 ``[Q, H, D]``."""
    n_q, h, d = q.shape
    n_k, hkv, _ = k.shape
    assert n_q <= n_k and h % hkv == 0, (q.shape, k.shape)
    assert sinks.shape == (h,) and sinks.dtype == torch.float32, (sinks.shape, sinks.dtype)
    assert window is None or window > 0, window
    k = k.repeat_interleave(h // hkv, dim=1)  # [L', H, D]
    v = v.repeat_interleave(h // hkv, dim=1)  # [L', H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, L']
    n_ctx = first_key_pos + n_k
    q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)
    k_pos = torch.arange(first_key_pos, n_ctx, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [Q, L']
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_col = sinks[:, None, None].expand(h, n_q, 1)  # [H, Q, 1]
    logits = torch.cat([scores, sink_col], dim=-1)  # [H, Q, L' + 1]
    logits = logits - logits.amax(dim=-1, keepdim=True)  # the sink column keeps every max finite
    weights = logits.exp()
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", weights[..., :-1], v)  # [Q, H, D], the sink's column dropped


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
    """Causal paged attention with one sink logit per head (see the module docstring).

    Args:
        q: f32 ``[T, H, D]``.
        k, v: f32 ``[T, Hkv, D]``, written into the caches at ``meta.slot_mapping`` first.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` (any float dtype).
        meta: where each token lives (:class:`AttentionMetadata`); scores scaled by ``meta.scale``.
        sinks: f32 ``[H]``, each head's sink logit (HF ``self_attn.sinks``).
        window: None for full attention; else a query at ``p`` sees keys ``p - window + 1 .. p``
            only, and no block before :func:`~zllm.domain.attention.first_window_block` is read.

    Returns:
        f32 ``[T, H, D]``.
    """
    t, h, d = q.shape
    assert q.dtype == k.dtype == v.dtype == torch.float32, (q.dtype, k.dtype, v.dtype)
    assert k.shape == v.shape and k.shape[0] == t and k.shape[2] == d and h % k.shape[1] == 0, (q.shape, k.shape)
    assert k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == tuple(k.shape[1:]), (k_cache.shape, k.shape)
    assert sum(meta.query_lens) == t and len(meta.context_lens) == len(meta.query_lens), meta
    assert all(0 < ql <= cl for ql, cl in zip(meta.query_lens, meta.context_lens, strict=True)), meta
    assert window is None or window > 0, window
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    bs = k_cache.shape[1]
    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        first = 0 if window is None else first_window_block(n_q, n_ctx, window, bs)
        ctx_k = gather_context(k_cache, meta.block_tables[s], n_ctx, first)  # [L', Hkv, D]
        ctx_v = gather_context(v_cache, meta.block_tables[s], n_ctx, first)  # [L', Hkv, D]
        out[start:start + n_q] = sink_softmax_attention(q[start:start + n_q], ctx_k, ctx_v, sinks, meta.scale,
                                                        window, first * bs)
        start += n_q
    return out


OPS = (
    OpDeclaration(
        name="attention_sinks", variants=("paged",),
        args=("q", "k", "v", "k_cache", "v_cache", "meta", "sinks", "window"),
        optional_args=("window",),
        signature="(q f32 [T, H, D], k f32 [T, Hkv, D], v f32 [T, Hkv, D], k_cache [NB, BS, Hkv, D], "
                  "v_cache [NB, BS, Hkv, D], meta AttentionMetadata, sinks f32 [H], window int or None) "
                  "-> f32 [T, H, D]: as attention (window None) or attention_sliding (window set), with "
                  "exp(sinks[h]) added to every softmax denominator of head h (sinks not scaled)",
        reference="zllm.domain.attention_sinks:attention_sinks",
        cases="zllm.conformance.cases:attention_sinks_cases",
    ),
)
