"""The DeepSeek-V2/V3 forward pass, top to bottom: MLA attention, dense or MoE FFN.

Dimension legend: T tokens in the batch, S' rows that need logits, C hidden size, H heads,
Dn/Dr/Dv the nope/rope/value head dims, R kv_lora_rank, W = R + Dr one cached latent row,
Rq q_lora_rank, F dense FFN size, E routed experts, N expert width, V vocabulary.
Every op goes through ``ops`` (the backend's bound kernels); this file names no backend.

With tensor parallelism each rank holds ``H / tp`` heads (their query, ``kv_b`` and ``o``
rows/columns), the whole latent projections and a replicated latent cache, ``1 / tp`` of every
FFN's intermediate dimension (dense, routed experts, shared experts), and ``V / tp`` vocabulary
rows; one all-reduce after ``o``, one after the FFN (``zllm_model_deepseek.family``). With
pipeline stages each rank runs only its stage's contiguous layers, and the MTP layers not at all.

Sources: DeepSeek-V2 (arXiv:2405.04434 §2.1 MLA, §2.2 DeepSeekMoE), DeepSeek-V3
(arXiv:2412.19437); transformers 5's ``DeepseekV2DecoderLayer`` / ``DeepseekV3DecoderLayer``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from zllm.plugin_api import (
    SINGLE,
    AttentionMetadata,
    CheckpointError,
    KVCacheSpec,
    KVLayerSpec,
    KVTensor,
    ParallelContext,
    QuantizedTensor,
    RopeTable,
    SharedExperts,
    concat_projections,
    dequantize,
    rope_inv_freq,
    stack_weights,
)
from zllm_model_deepseek.mtp import DeepseekMtp, mtp_weights
from zllm_model_deepseek.spec import DeepseekSpec


@attrs.frozen
class MoeWeights:
    """One MoE FFN: router weight f32 ``[E, C]``, its correction bias f32 ``[E]`` (V3) or None,
    expert stacks ``[E, N, C]`` / ``[E, N, C]`` / ``[E, C, N]``, and the shared experts."""

    gate: torch.Tensor
    correction_bias: torch.Tensor | None
    gate_exps: Any
    up_exps: Any
    down_exps: Any
    shared: SharedExperts | None


@attrs.frozen
class DeepseekLayer:
    """The weights of one decoder layer (q_proj or the q_a/q_b pair; dense ``mlp`` or ``moe``).

    ``q_kv_a`` is ``q`` (or ``q_a``) and ``kv_a`` joined at load (:func:`concat_projections`: the two
    projections of ``x`` as one GEMV, the same output rows) when they share a format and their
    biases agree (q_proj has none); ``q`` (``q_a``), ``kv_a`` and their biases are then None."""

    attn_norm: Any
    mlp_norm: Any
    kv_a: Any
    kv_a_norm: Any
    kv_b: Any
    o: Any
    q: Any = None
    q_a: Any = None
    q_a_norm: Any = None
    q_b: Any = None
    q_a_bias: Any = None
    kv_a_bias: Any = None
    o_bias: Any = None
    gate: Any = None
    up: Any = None
    down: Any = None
    moe: MoeWeights | None = None
    q_kv_a: Any = None
    q_kv_a_bias: Any = None


def _joined_q_kv_a(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with ``q`` (or ``q_a``) and ``kv_a`` joined into ``q_kv_a`` where they can be
    (see :class:`DeepseekLayer`), else unchanged."""
    first = "q" if fields["q"] is not None else "q_a"
    joined = concat_projections([fields[first], fields["kv_a"]],
                                [None if first == "q" else fields["q_a_bias"], fields["kv_a_bias"]])
    if joined is None:
        return fields
    return fields | {first: None, "kv_a": None, "q_a_bias": None, "kv_a_bias": None, "q_kv_a": joined[0],
                     "q_kv_a_bias": joined[1]}


def _kv_b(w: dict[str, Any], p: str, spec: DeepseekSpec, notes: dict[str, str]) -> Any:
    """``kv_b_proj [H * (Dn + Dv), R]``; a GGUF file's split ``k_b_proj [H, R, Dn]`` (transposed,
    llama.cpp's converter) and ``v_b_proj [H, Dv, R]`` are joined back per head, once.

    A quantized ``kv_b_proj`` stays quantized when each head's ``Dn + Dv`` rows start on a
    scale-block boundary (the kernels split it per head); otherwise it is dequantized here, once,
    and ``notes`` (name -> why, for ``--explain``) says so, as vLLM does. The converter
    quantizes ``v_b_proj`` (rows of ``R``) but not ``k_b_proj`` (rows of ``Dn``, rarely whole
    blocks), so a quantized half of a split pair is decoded and the join is f32."""
    m = spec.mla
    if not spec.kv_b_split:
        name = p + "self_attn.kv_b_proj.weight"
        kv_b = w[name]
        if isinstance(kv_b, QuantizedTensor) and (m.qk_nope_head_dim + m.v_head_dim) % kv_b.block_shape[0]:
            notes[name] = (f"{kv_b.fmt} scale blocks of {kv_b.block_shape[0]} rows do not align with a head's "
                           f"{m.qk_nope_head_dim + m.v_head_dim} rows: dequantized to f32 at load")
            return dequantize(kv_b)
        return kv_b
    k_b, v_b = w[p + "self_attn.k_b_proj.weight"], w[p + "self_attn.v_b_proj.weight"]
    if isinstance(k_b, QuantizedTensor) or isinstance(v_b, QuantizedTensor):
        notes[p + "self_attn.k_b_proj.weight"] = "joined with v_b_proj into kv_b_proj: dequantized to f32 at load"
        k_b, v_b = (dequantize(t) if isinstance(t, QuantizedTensor) else t.float() for t in (k_b, v_b))
    joined = torch.cat([k_b.transpose(1, 2), v_b.to(k_b.dtype)], dim=1)  # [H, Dn + Dv, R]
    return joined.reshape(-1, m.kv_lora_rank).contiguous()


def _experts(w: dict[str, Any], p: str, spec: DeepseekSpec, proj: str) -> Any:
    """The ``[E, ., .]`` stack of one expert projection, stacked once from per-expert tensors."""
    if spec.experts_stacked:
        return w[f"{p}mlp.experts.{proj}"]
    return stack_weights([w[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(spec.num_experts)])


def _layer(w: dict[str, Any], i: int, spec: DeepseekSpec, notes: dict[str, str]) -> DeepseekLayer:
    """Layer ``i``'s weights; an MTP layer (``i >= num_layers``) is MoE when the model has a
    router, as ``DeepseekFamily.tensor_specs`` reads it. ``notes``: see :func:`_kv_b`."""
    p = f"model.layers.{i}."
    moe_layer = spec.moe_layers[i] if i < spec.num_layers else spec.router is not None
    a = p + "self_attn."
    fields: dict[str, Any] = dict(
        attn_norm=w[p + "input_layernorm.weight"],
        mlp_norm=w[p + "post_attention_layernorm.weight"],
        kv_a=w[a + "kv_a_proj_with_mqa.weight"],
        kv_a_norm=w[a + "kv_a_layernorm.weight"],
        kv_b=_kv_b(w, p, spec, notes),
        o=w[a + "o_proj.weight"],
        q=w.get(a + "q_proj.weight"),
        q_a=w.get(a + "q_a_proj.weight"),
        q_a_norm=w.get(a + "q_a_layernorm.weight"),
        q_b=w.get(a + "q_b_proj.weight"),
        q_a_bias=w.get(a + "q_a_proj.bias"),
        kv_a_bias=w.get(a + "kv_a_proj_with_mqa.bias"),
        o_bias=w.get(a + "o_proj.bias"),
    )
    fields = _joined_q_kv_a(fields)
    if not moe_layer:
        return DeepseekLayer(
            **fields,
            gate=w[p + "mlp.gate_proj.weight"],
            up=w[p + "mlp.up_proj.weight"],
            down=w[p + "mlp.down_proj.weight"],
        )
    shared = None
    if spec.shared_intermediate_size:
        s = p + "mlp.shared_experts."
        shared = SharedExperts(
            w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
        )
    bias = w.get(p + "mlp.gate.e_score_correction_bias")
    moe = MoeWeights(
        gate=w[
            p + "mlp.gate.weight"
        ].float(),  # router logits in f32: a bf16 router flips expert choices
        correction_bias=None if bias is None else bias.float(),
        gate_exps=_experts(w, p, spec, "gate_proj"),
        up_exps=_experts(w, p, spec, "up_proj"),
        down_exps=_experts(w, p, spec, "down_proj"),
        shared=shared,
    )
    return DeepseekLayer(**fields, moe=moe)


class DeepseekModel:
    """A runnable DeepSeek-V2/V3 model over bound kernels ``ops``."""

    def __init__(self, spec: DeepseekSpec, weights: dict[str, Any], ops: Any, parallel: ParallelContext = SINGLE):
        self.spec, self.ops, self.parallel = spec, ops, parallel
        self._heads = spec.mla.num_heads // parallel.tp_size
        self._row_bias = parallel.tp_rank == 0  # a row-parallel bias is added once, before the all-reduce
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.context_length = spec.context_length
        m = spec.mla
        mine = parallel.stage_layers(spec.num_layers)
        # One latent row per token and layer of this stage, no V (DeepSeek-V2 §2.1.2); scores
        # scaled by (Dn + Dr) ** -0.5 times YaRN's mscale(mscale_all_dim) ** 2.
        self.kv_spec = KVCacheSpec(
            (KVLayerSpec((KVTensor("latent", 1, m.latent_dim),)),) * len(mine),
            attention_scale=m.softmax_scale,
        )
        self.embed = weights.get("model.embed_tokens.weight")  # first stage, and a tied last one
        self.lm_head = self.embed if spec.tie_word_embeddings else weights.get("lm_head.weight")
        self.norm = weights.get("model.norm.weight")
        self.load_notes: dict[str, str] = {}
        """Weights changed at load, name -> why (``zllm run --explain`` prints them)."""
        self.layers = [_layer(weights, i, spec, self.load_notes) for i in mine]
        # cos/sin rows over the decoupled rope dims [Dr/2], YaRN factor included.
        self.rope_table = RopeTable(*rope_inv_freq(m.qk_rope_head_dim, spec.rope), spec.context_length)
        self._rope = ops.variant("rope", spec.rope_variant)
        one_rank = parallel.tp_size == 1 and parallel.pp_size == 1
        self.mtp = self._mtp(weights) if one_rank else None
        """The first MTP layer as a speculative proposer, or None when the checkpoint stores
        none (transformers drops them on save) or with tensor or pipeline parallelism
        (speculative decoding runs on one rank). Further nextn layers are loaded, not run: the
        proposer applies the first one recursively (:mod:`zllm.runtime.mtp`)."""

    def _mtp(self, weights: dict[str, Any]) -> DeepseekMtp | None:
        p = f"model.layers.{self.spec.num_layers}."
        if not any(k.startswith(p) for k in weights):
            return None
        try:
            layer = _layer(weights, self.spec.num_layers, self.spec, self.load_notes)
        except KeyError as e:
            raise CheckpointError(p.rstrip("."), f"the MTP layer lacks {e.args[0]!r}") from None
        return DeepseekMtp(self, mtp_weights(weights, p, layer, self.lm_head))

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
        logits_indices: torch.Tensor,
        return_hidden: bool = False,
        hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """Logits f32 ``[S', V]`` for the rows ``logits_indices`` (see
        ``zllm.domain.family.Model``); ``kv_caches[i]`` is layer ``i``'s (of this stage)
        ``(latent_cache [NB, BS, 1, W],)``. ``return_hidden`` (one stage only): also every
        row's final-norm output ``[T, C]`` (what the MTP layer reads), as ``(logits, hidden)``.

        With pipeline stages: a stage after the first takes the previous stage's ``hidden``
        (its last FFN output and residual, f32 ``[T, C]`` each) instead of embedding
        ``token_ids``, and a stage before the last returns that pair for the next stage."""
        ops, eps = self.ops, self.spec.rms_norm_eps
        cos, sin = self.rope_table.rows(positions, max(meta.context_lens))  # [T, Dr/2] each
        par = self.parallel
        out = par.prenorm_layers(
            ops, eps, [(layer.attn_norm, layer.mlp_norm) for layer in self.layers],
            lambda i, x: self.attention(self.layers[i], x, cos, sin, meta, kv_caches[i][0].select(2, 0)),
            lambda i, x: self.ffn(self.layers[i], x),
            lambda: par.embedding(ops, self.embed, token_ids, self.vocab_size), hidden,
            None if return_hidden else logits_indices)
        if isinstance(out, tuple):  # [T, C] each, for the next stage
            return out
        x = ops.rms_norm(out, self.norm, eps)  # [S', C], or [T, C] with return_hidden
        if return_hidden:
            return par.logits(ops, x[logits_indices], self.lm_head, self.vocab_size), x  # [S', V], [T, C]
        return par.logits(ops, x, self.lm_head, self.vocab_size)  # [S', V]

    def attention(
        self,
        layer: DeepseekLayer,
        x: torch.Tensor,
        cos,
        sin,
        meta: AttentionMetadata,
        latent_cache: torch.Tensor,
    ) -> torch.Tensor:
        """MLA (DeepSeek-V2 §2.1): queries, the latent row ``[RMSNorm(c_kv) | rotated k_pe]`` to
        cache, attention over the cached rows, ``o_proj``. ``latent_cache`` ``[NB, BS, W]``."""
        ops, m = self.ops, self.spec.mla
        t, h, dn, r = x.shape[0], self._heads, m.qk_nope_head_dim, m.kv_lora_rank
        if layer.q_kv_a is not None:
            q_or_q_a, kv_a = ops.linear(x, layer.q_kv_a, layer.q_kv_a_bias).split(
                (layer.q_kv_a.shape[0] - r - m.qk_rope_head_dim, r + m.qk_rope_head_dim), dim=1
            )  # views [T, H * (Dn + Dr)] or [T, Rq], and [T, R + Dr]
        else:
            q_or_q_a = (ops.linear(x, layer.q) if layer.q is not None
                        else ops.linear(x, layer.q_a, layer.q_a_bias))  # [T, H * (Dn + Dr)] or [T, Rq]
            kv_a = ops.linear(x, layer.kv_a, layer.kv_a_bias)  # [T, R + Dr]
        if layer.q_b is None:
            q = q_or_q_a  # [T, H * (Dn + Dr)]
        else:
            q = ops.linear(ops.rms_norm(q_or_q_a, layer.q_a_norm, m.latent_norm_eps), layer.q_b)  # [T, H * (Dn + Dr)]
        q = q.view(t, h, m.qk_head_dim)
        q_nope = q[..., :dn]  # [T, H, Dn]
        q_pe = self._rope(q[..., dn:], cos, sin)  # [T, H, Dr] (the kernels take row-strided views)
        c_kv = ops.rms_norm(kv_a[:, :r], layer.kv_a_norm, m.latent_norm_eps)  # [T, R]
        k_pe = self._rope(kv_a[:, None, r:], cos, sin)  # [T, 1, Dr]: one rope key for all heads
        latent = torch.cat([c_kv, k_pe[:, 0]], dim=-1)  # [T, W]
        out = ops.mla_attention(q_nope, q_pe, latent, latent_cache, layer.kv_b, meta)  # [T, H, Dv]
        return ops.linear(out.reshape(t, h * m.v_head_dim), layer.o,
                          layer.o_bias if self._row_bias else None)  # [T, C]

    def ffn(self, layer: DeepseekLayer, x: torch.Tensor) -> torch.Tensor:
        """The dense SwiGLU MLP, or the MoE FFN with its shared experts (DeepSeek-V2 §2.2)."""
        ops, moe = self.ops, layer.moe
        if moe is None:
            return ops.linear(
                ops.silu_mul(ops.linear(x, layer.gate), ops.linear(x, layer.up)), layer.down
            )  # [T, C]
        router_logits = ops.linear(x, moe.gate)  # [T, E] f32
        return ops.moe(
            x,
            router_logits,
            self.spec.router,
            moe.gate_exps,
            moe.up_exps,
            moe.down_exps,
            moe.correction_bias,
            moe.shared,
        )  # [T, C]
