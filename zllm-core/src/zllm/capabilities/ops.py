"""Op signatures every backend kernel (and every f32 reference) implements.

Dimension legend: ``T`` tokens in the batch (all sequences flattened), ``S`` sequences,
``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``K`` in-features, ``N``
out-features, ``V`` vocabulary, ``NB`` KV blocks, ``BS`` block size (tokens per block),
``MB`` max blocks per sequence. Activations are f32 on the backend's device; weights are a
dense tensor in their stored dtype or a :class:`~zllm.weights.formats.QuantizedTensor`.

=============  ==========================================================================
op             signature
=============  ==========================================================================
embedding      ``(weight [V, K], ids int64 [T]) -> f32 [T, K]``
linear         ``(x f32 [T, K], weight [N, K], bias f32|None [N]) -> f32 [T, N]``
rms_norm       ``(x f32 [T, K], weight [K], eps float) -> f32 [T, K]``
add_rms_norm   ``(x f32 [T, K], residual f32 [T, K], weight [K], eps float) -> (f32 [T, K],
               f32 [T, K])`` = ``(rms_norm(x + residual), x + residual)``
rope           ``(x f32 [T, H, D], cos f32 [T, D/2], sin f32 [T, D/2]) -> f32 [T, H, D]``;
               variant ``neox``: half-rotation (GPT-NeoX / HF) layout, pairs ``(i, i + D/2)``;
               variant ``gptj``: interleaved layout, pairs ``(2i, 2i + 1)``
attention      ``(q f32 [T, H, D], k f32 [T, Hkv, D], v f32 [T, Hkv, D], k_cache
               [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, D], meta AttentionMetadata)
               -> f32 [T, H, D]``; writes k, v at ``meta.slot_mapping`` first
attention_     ``(q, k, v, k_cache, v_cache, meta, window int) -> f32 [T, H, D]``: as
sliding        ``attention``, but a query at position ``p`` sees only keys ``p - window + 1
               .. p`` (HF ``sliding_window_overlay``). Must not read a block before the one
               holding key ``L - Q - window + 1``: the KV cache may have freed it (-1 in
               ``meta.block_tables``)
silu_mul       ``(gate f32 [T, N], up f32 [T, N]) -> f32 [T, N]`` = ``silu(gate) * up``
sample         ``(logits f32 [S, V], params list[SamplingRow]) -> int64 [S]``
=============  ==========================================================================
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where each token of a flattened batch lives in the paged KV cache.

    Sequences appear in the batch in order; sequence ``s`` contributes ``query_lens[s]``
    consecutive tokens, which are the last ``query_lens[s]`` of its ``context_lens[s]``
    cached tokens (so a New Prefill has ``query_len == context_len``, an Append Prefill
    ``query_len < context_len``, a decode step ``query_len == 1``). Attention is causal.

    Attributes:
        slot_mapping: int64 ``[T]``, cache slot ``block * BS + offset`` of each new token.
        block_tables: int64 ``[S, MB]``, physical block ids of each sequence (padding -1).
        query_lens: ``S`` ints, new tokens per sequence.
        context_lens: ``S`` ints, cached tokens per sequence including the new ones.
        scale: softmax scale, usually ``D ** -0.5``.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    scale: float


@attrs.frozen(eq=False)
class SamplingRow:
    """Sampling settings and state for one sequence (one row of the logits).

    Order of application (vLLM / HF ``generate``): repetition penalty, presence and
    frequency penalties, temperature, top-k, top-p, min-p, then a draw. ``temperature == 0``
    is greedy (argmax of the penalised logits).

    Attributes:
        temperature: >= 0.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; 0 disables.
        repetition_penalty: > 0; 1 disables. Divides positive logits, multiplies negative
            ones, for tokens in the prompt or output (CTRL, Keskar et al. 2019; HF).
        presence_penalty, frequency_penalty: OpenAI semantics over output tokens only:
            ``logit -= presence * (count > 0) + frequency * count``.
        prompt_token_ids, output_token_ids: int64 ``[P]`` / ``[O]`` on the logits' device.
        generator: a per-request ``torch.Generator`` (seeded when the request gives a seed).
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor
    generator: torch.Generator | None
