"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a speculative proposer.

Dimension legend: T rows, S' rows returned, C hidden size, V vocabulary.

A checkpoint with ``num_nextn_predict_layers: 1`` stores it as ``model.layers.{L}.*``, ``L`` =
``num_hidden_layers`` (DeepSeek-V3 §2.2, eq. 21-23; the wiring the released checkpoints expect
is that of vLLM's ``deepseek_mtp.py`` and SGLang's ``deepseek_nextn.py``)::

    x_i   = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])      # [2C] -> [C]
    g_i   = TRM(x_i)                                           # one decoder layer: MLA + FFN
    P_i+2 = softmax(shared_head.head(shared_head.norm(g_i)))

- ``h_i`` is the main model's hidden state after its final norm, the vector its output head
  reads (``DeepseekModel.forward(..., return_hidden=True)``), as vLLM and SGLang hand it over.
- The concatenation puts the embedding first (the paper's eq. 21 writes the hidden state
  first; the checkpoints' ``eh_proj`` — "e" then "h" — takes the embedding first, as both
  engines feed it).
- The decoder layer is an ordinary layer of the family (MLA over the MTP layer's own latent
  cache, then the MoE FFN of a layer past ``first_k_dense_replace``); its output is the
  residual stream after the FFN, without a norm: ``g_i`` feeds the head and, when the layer
  is applied again for a further proposal, its ``hnorm`` input.
- ``Emb`` is the main model's embedding (shared, §2.2); the layer's stored copy
  ``embed_tokens`` is accepted and not kept. ``shared_head.head`` is used when stored, else
  ``lm_head``.
- vLLM zeroes the embedding of position 0 (a leftover of an older row layout); the paper and
  SGLang do not, nor does this.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from zllm.plugin_api import AttentionMetadata, CheckpointError, KVCacheSpec, KVLayerSpec, KVTensor

#: Tensors of an MTP layer besides its decoder layer's, after ``model.layers.{L}.``.
MTP_REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@attrs.frozen
class MtpWeights:
    """``enorm``/``hnorm``/``head_norm`` ``[C]``, ``eh_proj`` ``[C, 2C]``, ``head`` ``[V, C]``
    and the decoder ``layer`` (a :class:`~zllm_model_deepseek.model.DeepseekLayer`)."""

    enorm: Any
    hnorm: Any
    eh_proj: Any
    head_norm: Any
    head: Any
    layer: Any


def mtp_weights(weights: dict[str, Any], prefix: str, layer: Any, lm_head: Any) -> MtpWeights:
    """The MTP layer at ``prefix`` (``model.layers.{L}.``), its decoder ``layer`` already built.

    Raises:
        CheckpointError: a tensor the layer needs is missing while others of it are stored.
    """
    missing = [n for n in MTP_REQUIRED if prefix + n not in weights]
    if missing:
        raise CheckpointError(prefix.rstrip("."), f"the MTP layer lacks {prefix + missing[0]!r}")
    return MtpWeights(
        enorm=weights[prefix + "enorm.weight"],
        hnorm=weights[prefix + "hnorm.weight"],
        eh_proj=weights[prefix + "eh_proj.weight"],
        head_norm=weights[prefix + "shared_head.norm.weight"],
        head=weights.get(prefix + "shared_head.head.weight", lm_head),
        layer=layer,
    )


class DeepseekMtp:
    """The MTP layer of a :class:`~zllm_model_deepseek.model.DeepseekModel` (a
    :class:`zllm.domain.family.MultiTokenPredictor`): it shares the model's kernels, RoPE
    table, embedding and layer code, and caches one latent row per position."""

    def __init__(self, model: Any, weights: MtpWeights):
        self.model, self.w = model, weights
        m = model.spec.mla
        self.kv_spec = KVCacheSpec((KVLayerSpec((KVTensor("latent", 1, m.latent_dim),)),),
                                   attention_scale=m.softmax_scale)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, ...]],
                rows: torch.Tensor) -> torch.Tensor:
        """``g`` ``[S', C]`` at ``rows`` for tokens ``t_{i+1}`` int64 ``[T]`` and hidden states
        ``h_i`` ``[T, C]``; ``kv_caches`` is ``[(latent_cache [NB, BS, 1, W],)]``."""
        model, w = self.model, self.w
        ops, eps = model.ops, model.spec.rms_norm_eps
        cos, sin = model.rope_table.rows(positions, max(meta.context_lens))  # [T, Dr/2] each
        e = ops.rms_norm(ops.embedding(model.embed, token_ids), w.enorm, eps)  # [T, C]
        h = ops.rms_norm(hidden, w.hnorm, eps)  # [T, C]
        residual = ops.linear(torch.cat([e, h], dim=-1), w.eh_proj)  # [T, 2C] -> [T, C]
        x = ops.rms_norm(residual, w.layer.attn_norm, eps)
        attn = model.attention(w.layer, x, cos, sin, meta, kv_caches[0][0][:, :, 0])  # [T, C]
        x, residual = ops.add_rms_norm(attn, residual, w.layer.mlp_norm, eps)
        ffn = model.ffn(w.layer, x)  # [T, C]
        return ffn[rows] + residual[rows]  # [S', C]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """f32 ``[S, V]``: ``shared_head.head(shared_head.norm(g))`` for ``g`` ``[S, C]``."""
        ops = self.model.ops
        return ops.linear(ops.rms_norm(hidden, self.w.head_norm, self.model.spec.rms_norm_eps), self.w.head)
