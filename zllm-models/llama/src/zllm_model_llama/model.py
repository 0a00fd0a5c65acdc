"""The llama-style forward pass (llama, mistral, qwen2, qwen3 and the MoE types mixtral,
qwen2_moe, qwen3_moe), top to bottom (after gpt-fast's ``model.py``).

Dimension legend: T tokens in the batch, S' rows that need logits, H query heads, Hkv KV
heads, D head dim, C hidden size, F FFN size, V vocabulary, E routed experts, N expert width.
Every op goes through ``ops`` (the backend's bound kernels); this file names no backend.

With tensor parallelism (``parallel.tp_size`` > 1) each rank holds the shards
``zllm_model_llama.family.tensor_shards`` gives it — its ``H / tp`` query heads, their KV
heads, ``F / tp`` FFN rows and ``V / tp`` vocabulary rows — and the forward joins them with
one all-reduce after O, one after down (Megatron-LM, arXiv:1909.08053 §3), one after the
vocabulary-parallel embedding, and one all-gather of the logits.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from zllm.plugin_api import (
    SINGLE,
    AttentionMetadata,
    KVCacheSpec,
    KVLayerSpec,
    ParallelContext,
    RopeTable,
    SharedExperts,
    concat_projections,
    rope_inv_freq,
    stack_weights,
)
from zllm_model_llama.spec import LlamaSpec, MoeSpec


@attrs.frozen
class MoeLayer:
    """The MoE FFN weights of one layer: router ``[E, C]``, expert stacks ``gate``/``up``
    ``[E, N, C]`` and ``down`` ``[E, C, N]``, and the shared experts (Qwen2-MoE) or None."""

    router: Any
    gate: Any
    up: Any
    down: Any
    shared: SharedExperts | None = None

    @classmethod
    def from_weights(cls, w: dict[str, Any], p: str, moe: MoeSpec, layout: str,
                     parallel: ParallelContext = SINGLE) -> MoeLayer:
        """Stack the experts once, from the checkpoint's ``layout`` (see
        ``zllm_model_llama.family.EXPERT_LAYOUTS``); a fused ``gate_up_proj`` is split into two
        views (this rank's rows of each half), stacks are used as stored (already sharded)."""
        gate, up, down = moe.expert_names
        if layout == "per_expert":
            stacks = [stack_weights([w[f"{p}experts.{e}.{name}.weight"] for e in range(moe.num_experts)])
                      for name in (gate, up, down)]
        elif layout == "fused":
            gate_up = w[p + "experts.gate_up_proj"]  # [E, 2N, C]: gate rows, then up rows
            n = moe.expert_size
            rows = parallel.split(n, 1)
            stacks = [gate_up.narrow(1, rows.start, rows.size), gate_up.narrow(1, n + rows.start, rows.size),
                      w[p + "experts.down_proj"]]
        else:
            stacks = [w[f"{p}experts.{name}.weight"] for name in (gate, up, down)]
        shared = None
        if moe.shared_size is not None:
            shared = SharedExperts(w[p + "shared_expert.gate_proj.weight"], w[p + "shared_expert.up_proj.weight"],
                                   w[p + "shared_expert.down_proj.weight"], w[p + "shared_expert_gate.weight"])
        gate_exps, up_exps, down_exps = stacks
        return cls(w[p + "gate.weight"], gate_exps, up_exps, down_exps, shared=shared)


@attrs.frozen
class LlamaLayer:
    """The weights of one decoder layer (biases and q/k norms are None unless the config has them).

    ``qkv`` ``[(H + 2 Hkv) D, C]`` is q, k and v joined at load (:func:`concat_projections`: one GEMV
    a decode step instead of three, the same output rows) when they share a format and all or
    none have biases; ``q``, ``k``, ``v`` (and their biases) are then None."""

    attn_norm: Any
    q: Any
    k: Any
    v: Any
    o: Any
    mlp_norm: Any
    gate: Any = None
    up: Any = None
    down: Any = None
    moe: MoeLayer | None = None
    q_bias: Any = None
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None
    q_norm: Any = None
    k_norm: Any = None
    qkv: Any = None
    qkv_bias: Any = None

    @classmethod
    def from_weights(cls, w: dict[str, Any], i: int, moe: MoeLayer | None = None) -> LlamaLayer:
        p = f"model.layers.{i}."
        proj = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
        if moe is None:
            proj |= {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
        fields = {k: w[p + n + ".weight"] for k, n in proj.items()}
        fields |= {k + "_bias": w.get(p + n + ".bias") for k, n in proj.items()}
        joined = concat_projections([fields[k] for k in "qkv"], [fields[k + "_bias"] for k in "qkv"])
        if joined is not None:
            fields |= {k: None for k in ("q", "k", "v", "q_bias", "k_bias", "v_bias")}
            fields |= {"qkv": joined[0], "qkv_bias": joined[1]}
        return cls(attn_norm=w[p + "input_layernorm.weight"], mlp_norm=w[p + "post_attention_layernorm.weight"],
                   q_norm=w.get(p + "self_attn.q_norm.weight"), k_norm=w.get(p + "self_attn.k_norm.weight"),
                   moe=moe, **fields)


class LlamaModel:
    """A runnable llama model over bound kernels ``ops``."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, Any], ops: Any, expert_layouts: tuple[str | None, ...] = (),
                 parallel: ParallelContext = SINGLE):
        """``expert_layouts[i]``: how layer ``i``'s experts are stored (None: a dense FFN);
        ``weights`` holds this rank's shards of ``parallel``, and with pipeline stages only
        this stage's layers (:meth:`ParallelContext.stage_layers`)."""
        self.spec, self.ops, self.parallel = spec, ops, parallel
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.context_length = spec.context_length
        kv_heads = parallel.kv_heads(spec.num_heads, spec.num_kv_heads)[1]
        mine = parallel.stage_layers(spec.num_layers)
        self._windows = spec.layer_windows[mine.start: mine.stop]
        # K and V of this rank's Hkv heads per layer of its stage, each layer with its own window; scores
        # scaled by D ** -0.5 (HF LlamaAttention.scaling; YaRN's factor scales cos/sin instead, as HF does).
        self.kv_spec = KVCacheSpec(
            tuple(KVLayerSpec.gqa(kv_heads, spec.head_dim, window) for window in self._windows),
            attention_scale=spec.head_dim ** -0.5,
        )
        self.embed = weights.get("model.embed_tokens.weight")  # first stage, and a tied last one
        self.lm_head = self.embed if spec.tie_word_embeddings else weights.get("lm_head.weight")
        self.norm = weights.get("model.norm.weight")
        layouts = expert_layouts or (None,) * spec.num_layers
        self.layers = [
            LlamaLayer.from_weights(weights, i, None if layout is None or spec.moe is None else
                                    MoeLayer.from_weights(weights, f"model.layers.{i}.{spec.moe.prefix}.", spec.moe,
                                                          layout, parallel))
            for i, layout in zip(mine, layouts[mine.start: mine.stop], strict=True)
        ]
        self.rope_table = RopeTable(*rope_inv_freq(spec.head_dim, spec.rope), spec.context_length)  # [D2] rows
        # Plain ints for the per-layer code (the spec's properties would recompute them each call).
        self._heads, self._kv_heads, self._head_dim = spec.num_heads // parallel.tp_size, kv_heads, spec.head_dim
        self._q_size = self._heads * spec.head_dim
        # A row-parallel layer's bias is added once, on the first rank, before the all-reduce.
        self._row_bias = parallel.tp_rank == 0

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
        hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """Logits f32 ``[S', V]`` for the rows ``logits_indices`` of the batch (see ``zllm.domain.family.Model``).

        With pipeline stages: a stage after the first takes the previous stage's ``hidden``
        (its last MLP output and residual, f32 ``[T, C]`` each) instead of embedding
        ``token_ids``, and a stage before the last returns that pair for the next stage."""
        ops, eps, par = self.ops, self.spec.rms_norm_eps, self.parallel
        cos, sin = self.rope_table.rows(positions, max(meta.context_lens))  # [T, D/2] each
        out = par.prenorm_layers(
            ops, eps, [(layer.attn_norm, layer.mlp_norm) for layer in self.layers],
            lambda i, x: self.attention(self.layers[i], x, cos, sin, meta, kv_caches[i], self._windows[i]),
            lambda i, x: self.mlp(self.layers[i], x),
            lambda: par.embedding(ops, self.embed, token_ids, self.vocab_size), hidden, logits_indices)
        if isinstance(out, tuple):  # [T, C] each, for the next stage
            return out
        x = ops.rms_norm(out, self.norm, eps)  # [S', C]
        return self.parallel.logits(ops, x, self.lm_head, self.vocab_size)  # [S', V]

    def attention(self, layer: LlamaLayer, x: torch.Tensor, cos, sin, meta: AttentionMetadata, kv_cache,
                  window: int | None) -> torch.Tensor:
        ops, H, Hkv, D = self.ops, self._heads, self._kv_heads, self._head_dim
        T = x.shape[0]
        if layer.qkv is not None:
            qkv = ops.linear(x, layer.qkv, layer.qkv_bias)  # [T, (H + 2 Hkv) D]
            q, k, v = qkv.split((self._q_size, Hkv * D, Hkv * D), dim=1)  # views [T, H*D], [T, Hkv*D] x2
        else:
            q = ops.linear(x, layer.q, layer.q_bias)  # [T, H*D]
            k = ops.linear(x, layer.k, layer.k_bias)  # [T, Hkv*D]
            v = ops.linear(x, layer.v, layer.v_bias)  # [T, Hkv*D]
        if layer.q_norm is not None:  # qwen3: RMSNorm over each head's D features, before RoPE
            eps = self.spec.rms_norm_eps
            q = ops.rms_norm(q.reshape(T * H, D), layer.q_norm, eps)  # [T*H, D]
            k = ops.rms_norm(k.reshape(T * Hkv, D), layer.k_norm, eps)  # [T*Hkv, D]
        q = ops.rope(q.view(T, H, D), cos, sin)  # [T, H, D]
        k = ops.rope(k.view(T, Hkv, D), cos, sin)  # [T, Hkv, D]
        v = v.view(T, Hkv, D)  # [T, Hkv, D]
        if window is None:
            out = ops.attention(q, k, v, kv_cache[0], kv_cache[1], meta)  # [T, H, D]
        else:
            out = ops.attention_sliding(q, k, v, kv_cache[0], kv_cache[1], meta, window)  # [T, H, D]
        return ops.linear(out.reshape(T, self._q_size), layer.o, layer.o_bias if self._row_bias else None)  # [T, C]

    def mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if layer.moe is not None:
            assert self.spec.moe is not None
            m = layer.moe
            router_logits = ops.linear(x, m.router)  # [T, E], f32 (the choice is rounding-sensitive)
            return ops.moe(x, router_logits, self.spec.moe.router, m.gate, m.up, m.down, None, m.shared)  # [T, C]
        gate = ops.linear(x, layer.gate, layer.gate_bias)  # [T, F]
        hidden = ops.silu_mul(gate, ops.linear(x, layer.up, layer.up_bias))  # [T, F]
        return ops.linear(hidden, layer.down, layer.down_bias if self._row_bias else None)  # [T, C]
