"""The gpt-oss forward pass, top to bottom (OpenAI's ``gpt_oss/torch/model.py``; HF
transformers 5.24 ``modeling_gpt_oss.py``).

Dimension legend: T tokens in the batch, S' rows that need logits, H query heads, Hkv KV
heads, D head dim, C hidden size, V vocabulary, E experts, N expert width.
Every op goes through ``ops`` (the backend's bound kernels); this file names no backend.

A decoder layer: pre-norm attention with q/k/v/o biases, half-rotation RoPE (YaRN) and one
sink logit per head, sliding-window or full by layer; then a pre-norm MoE FFN: router
logits with a bias, top-k then softmax over the k, and experts with biases and the clamped
SwiGLU.

With tensor parallelism (``parallel.tp_size`` > 1) each rank holds the shards
``zllm_model_gpt_oss.family.tensor_shards`` gives it — its ``H / tp`` query heads with their
sinks, their KV heads, every expert's ``N / tp`` width and ``V / tp`` vocabulary rows — and the
forward joins them with one all-reduce after O, one after the experts, one after the
vocabulary-parallel embedding and one all-gather of the logits (Megatron-LM, arXiv:1909.08053
§3). With pipeline stages each rank runs only its stage's contiguous layers.
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
    QuantizedTensor,
    RopeTable,
    rope_inv_freq,
)
from zllm_model_gpt_oss.spec import GptOssSpec

#: How a checkpoint stores a layer's experts: transformers' fused ``gate_up_proj [E, C, 2N]``
#: (gate in the even columns) + ``down_proj [E, N, C]`` (``x @ W``) — or, quantized, the same
#: two in row layout ``[E, 2N, C]`` (gate in the even rows) / ``[E, C, N]`` — or GGUF's stacks
#: ``[E, N, C]`` / ``[E, C, N]`` per projection (``x W^T``; llama.cpp's converter
#: de-interleaves and transposes).
EXPERT_LAYOUTS = ("fused", "stacked")


@attrs.frozen
class Experts:
    """One layer's experts as the ``moe_clamped_swiglu`` op takes them: ``gate``/``up`` ``[E, N, C]``,
    ``down`` ``[E, C, N]``, biases ``[E, N]``, ``[E, N]``, ``[E, C]``."""

    gate: Any
    up: Any
    down: Any
    gate_bias: Any
    up_bias: Any
    down_bias: Any

    @classmethod
    def from_weights(cls, w: dict[str, Any], p: str, layout: str) -> Experts:
        """The experts under prefix ``p`` (``model.layers.{i}.mlp.experts.``) in ``layout``.

        A fused dense ``gate_up_proj`` is de-interleaved and transposed once here (a copy in its
        stored dtype); a fused quantized one (row layout) has its even and odd rows gathered
        into two stacks that stay in their format; stacks are used as stored."""
        if layout == "stacked":
            return cls(*(w[f"{p}{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj")),
                       *(w[f"{p}{name}.bias"] for name in ("gate_proj", "up_proj", "down_proj")))
        gate_up, bias, down = w[p + "gate_up_proj"], w[p + "gate_up_proj_bias"], w[p + "down_proj"]  # bias [E, 2N]
        biases = (bias[:, 0::2].contiguous(), bias[:, 1::2].contiguous(), w[p + "down_proj_bias"])
        if isinstance(gate_up, QuantizedTensor):  # [E, 2N, C], down [E, C, N]
            return cls(_row_stack(gate_up, 0), _row_stack(gate_up, 1), down, *biases)
        return cls(gate_up[:, :, 0::2].transpose(1, 2).contiguous(),  # [E, N, C]
                   gate_up[:, :, 1::2].transpose(1, 2).contiguous(),  # [E, N, C]
                   down.transpose(1, 2).contiguous(),  # [E, C, N]
                   *biases)


def _row_stack(stack: QuantizedTensor, start: int) -> QuantizedTensor:
    """Rows ``start, start + 2, ..`` of every expert of a quantized ``[E, R, C]`` stack, as a
    ``[E, R / 2, C]`` stack in the same format (its parts gathered, never decoded)."""
    e, r, c = stack.shape
    ids = torch.arange(start, r, 2)
    experts = [stack[i].rows(ids) for i in range(e)]
    parts = {name: torch.stack([x.parts[name] for x in experts]) for name in experts[0].parts}
    return QuantizedTensor(parts, stack.fmt, (e, len(ids), c), block=experts[0].block)


@attrs.frozen
class GptOssLayer:
    """The weights of one decoder layer (attention biases are None when ``attention_bias`` is false)."""

    attn_norm: Any
    q: Any
    k: Any
    v: Any
    o: Any
    sinks: torch.Tensor
    mlp_norm: Any
    router: Any
    router_bias: Any
    experts: Experts
    q_bias: Any = None
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None

    @classmethod
    def from_weights(cls, w: dict[str, Any], i: int, layout: str) -> GptOssLayer:
        p = f"model.layers.{i}."
        proj = {name: p + f"self_attn.{name}_proj" for name in ("q", "k", "v", "o")}
        return cls(attn_norm=w[p + "input_layernorm.weight"], mlp_norm=w[p + "post_attention_layernorm.weight"],
                   sinks=w[p + "self_attn.sinks"].float(), router=w[p + "mlp.router.weight"],
                   router_bias=w[p + "mlp.router.bias"], experts=Experts.from_weights(w, p + "mlp.experts.", layout),
                   **{name: w[n + ".weight"] for name, n in proj.items()},
                   **{name + "_bias": w.get(n + ".bias") for name, n in proj.items()})


class GptOssModel:
    """A runnable gpt-oss model over bound kernels ``ops``."""

    def __init__(self, spec: GptOssSpec, weights: dict[str, Any], ops: Any, expert_layouts: tuple[str, ...],
                 parallel: ParallelContext = SINGLE):
        """``expert_layouts``: how each layer of this stage stores its experts (:data:`EXPERT_LAYOUTS`);
        ``weights`` holds this rank's shards of ``parallel``, and with pipeline stages only this
        stage's layers (:meth:`ParallelContext.stage_layers`)."""
        self.spec, self.ops, self.parallel = spec, ops, parallel
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        self.context_length = spec.context_length
        kv_heads = parallel.kv_heads(spec.num_heads, spec.num_kv_heads)[1]
        mine = parallel.stage_layers(spec.num_layers)
        self._windows = spec.layer_windows[mine.start: mine.stop]
        # K and V of this rank's Hkv heads per layer of its stage, each layer with its own window;
        # scores scaled by D ** -0.5 (GptOssAttention.scaling; YaRN's attention factor scales
        # cos/sin, as HF does).
        self.kv_spec = KVCacheSpec(
            tuple(KVLayerSpec.gqa(kv_heads, spec.head_dim, window) for window in self._windows),
            attention_scale=spec.head_dim ** -0.5,
        )
        self.embed = weights.get("model.embed_tokens.weight")  # first stage, and a tied last one
        self.lm_head = self.embed if spec.tie_word_embeddings else weights.get("lm_head.weight")
        self.norm = weights.get("model.norm.weight")
        self.layers = [GptOssLayer.from_weights(weights, i, layout)
                       for i, layout in zip(mine, expert_layouts, strict=True)]
        self.rope_table = RopeTable(*rope_inv_freq(spec.head_dim, spec.rope), spec.context_length)
        self._heads, self._kv_heads, self._head_dim = spec.num_heads // parallel.tp_size, kv_heads, spec.head_dim
        # Row-parallel biases (o_proj's, the experts' down bias) are added once, on the first rank,
        # before the all-reduce; the other ranks add zeros to their experts' partial sums.
        self._row_bias = parallel.tp_rank == 0
        if not self._row_bias:
            self.layers = [attrs.evolve(layer, o_bias=None, experts=attrs.evolve(
                layer.experts, down_bias=torch.zeros_like(layer.experts.down_bias))) for layer in self.layers]

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
        return par.logits(ops, x, self.lm_head, self.vocab_size)  # [S', V]

    def attention(self, layer: GptOssLayer, x: torch.Tensor, cos, sin, meta: AttentionMetadata, kv_cache,
                  window: int | None) -> torch.Tensor:
        ops, H, Hkv, D = self.ops, self._heads, self._kv_heads, self._head_dim
        T = x.shape[0]
        q = ops.rope(ops.linear(x, layer.q, layer.q_bias).view(T, H, D), cos, sin)  # [T, H, D]
        k = ops.rope(ops.linear(x, layer.k, layer.k_bias).view(T, Hkv, D), cos, sin)  # [T, Hkv, D]
        v = ops.linear(x, layer.v, layer.v_bias).view(T, Hkv, D)  # [T, Hkv, D]
        out = ops.attention_sinks(q, k, v, kv_cache[0], kv_cache[1], meta, layer.sinks, window)  # [T, H, D]
        return ops.linear(out.reshape(T, H * D), layer.o, layer.o_bias)  # [T, C]

    def mlp(self, layer: GptOssLayer, x: torch.Tensor) -> torch.Tensor:
        ops, e = self.ops, layer.experts
        router_logits = ops.linear(x, layer.router, layer.router_bias)  # [T, E]
        ids, weights = ops.router_topk_softmax(router_logits, self.spec.experts_per_tok)  # [T, k] each
        return ops.moe_clamped_swiglu(x, ids, weights, e.gate, e.up, e.down, e.gate_bias, e.up_bias, e.down_bias,
                                      self.spec.swiglu_alpha, self.spec.swiglu_limit)  # [T, C]
