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
optional sliding window that reads no freed block — is :func:`zllm.domain.attention.attention`'s:
both run :func:`zllm.domain.attention.paged_attention`, this one with the sinks.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import AttentionMetadata, OpDeclaration
from zllm.domain.attention import causal_softmax_attention, paged_attention


def sink_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                           window: int | None = None, first_key_pos: int = 0) -> torch.Tensor:
    """Attention of ``q`` f32 ``[Q, H, D]`` over ``k``, ``v`` f32 ``[L', Hkv, D]`` (keys at absolute
    positions ``first_key_pos ..``; the last ``Q`` keys are the queries) with one sink logit
    per head, ``sinks`` f32 ``[H]``; with ``window`` a query at ``p`` sees only keys
    ``> p - window``. Returns f32 ``[Q, H, D]``."""
    return causal_softmax_attention(q, k, v, scale, window, first_key_pos, sinks)


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
    assert window is None or window > 0, window
    return paged_attention(q, k, v, k_cache, v_cache, meta, window, sinks)


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
