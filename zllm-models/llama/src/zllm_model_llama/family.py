"""The llama-style families: config -> spec, needed capabilities, tensor specs, model factory.

One layer code (:mod:`zllm_model_llama.model`) serves every family here; each family class
only names its HF ``model_type`` rules (:mod:`zllm_model_llama.spec`).
"""

from __future__ import annotations

from typing import Any

from zllm.plugin_api import Capability, TensorSpec
from zllm_model_llama.model import LlamaModel
from zllm_model_llama.spec import LLAMA, MISTRAL, QWEN2, QWEN3, ArchRules, LlamaSpec, spec_from_config

LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


class LlamaFamily:
    """Factory for llama models (see :class:`zllm.domain.family.ModelFamily`)."""

    name = "llama"
    rules: ArchRules = LLAMA

    def parse_config(self, config: dict[str, Any], source: str) -> LlamaSpec:
        return spec_from_config(config, source, self.rules)

    def tensor_specs(self, spec: LlamaSpec) -> dict[str, TensorSpec]:
        h, f, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
        specs = {
            "model.embed_tokens.weight": TensorSpec((spec.vocab_size, h)),
            "model.norm.weight": TensorSpec((h,)),
            # A tied checkpoint may still store lm_head.weight (equal to the embedding).
            "lm_head.weight": TensorSpec((spec.vocab_size, h), optional=spec.tie_word_embeddings),
        }
        shapes = {
            "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
        }
        bias = {"self_attn.q_proj": spec.qkv_bias, "self_attn.k_proj": spec.qkv_bias, "self_attn.v_proj": spec.qkv_bias,
                "self_attn.o_proj": spec.o_bias, "mlp.gate_proj": spec.mlp_bias, "mlp.up_proj": spec.mlp_bias,
                "mlp.down_proj": spec.mlp_bias}
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            specs[p + "input_layernorm.weight"] = TensorSpec((h,))
            specs[p + "post_attention_layernorm.weight"] = TensorSpec((h,))
            if spec.qk_norm:
                specs[p + "self_attn.q_norm.weight"] = TensorSpec((spec.head_dim,))
                specs[p + "self_attn.k_norm.weight"] = TensorSpec((spec.head_dim,))
            for name, shape in shapes.items():
                specs[p + name + ".weight"] = TensorSpec(shape)
                if bias[name]:
                    specs[p + name + ".bias"] = TensorSpec((shape[0],))
        return specs

    def required_capabilities(self, spec: LlamaSpec, weight_formats: dict[str, str]) -> frozenset[Capability]:
        embed_fmt = weight_formats["model.embed_tokens.weight"]
        head_fmt = weight_formats.get("lm_head.weight", embed_fmt) if not spec.tie_word_embeddings else embed_fmt
        linear_fmts = {fmt for name, fmt in weight_formats.items() if name.endswith("_proj.weight")} | {head_fmt}
        return _capabilities(embed_fmt, linear_fmts, full=None in spec.layer_windows,
                             sliding=any(w is not None for w in spec.layer_windows), ropes={spec.rope_variant})

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        # The most any checkpoint of this family may need when all its weights are stored in
        # ``fmt`` (used by ``zllm compat``): a cell it calls declared never fails at load.
        # Both RoPE layouts: HF checkpoints rotate half-rotation pairs, GGUF llama files
        # adjacent pairs, in every format.
        return _capabilities(fmt, {fmt}, full=True, sliding=self.rules.sliding != "none", ropes={"neox", "gptj"})

    def build(self, spec: LlamaSpec, weights: dict[str, Any], ops: Any) -> LlamaModel:
        return LlamaModel(spec, weights, ops)


class MistralFamily(LlamaFamily):
    """Mistral: llama layers, no biases, optional sliding window on every layer."""

    name = "mistral"
    rules = MISTRAL


class Qwen2Family(LlamaFamily):
    """Qwen2: q/k/v biases, per-layer full or sliding attention."""

    name = "qwen2"
    rules = QWEN2


class Qwen3Family(LlamaFamily):
    """Qwen3: per-head q/k RMSNorm before RoPE, explicit head_dim, per-layer full or sliding attention."""

    name = "qwen3"
    rules = QWEN3


def _capabilities(embed_fmt: str, linear_fmts: set[str], full: bool, sliding: bool,
                  ropes: set[str]) -> frozenset[Capability]:
    """The one place that lists what a llama-style model needs: the weight ops in their
    formats, the attention variants its layers use, the RoPE layouts, and the fixed math ops. Shared by
    ``required_capabilities`` and ``format_capabilities`` so the compatibility matrix and
    the load-time check cannot disagree."""
    return frozenset(
        {Capability("embedding", embed_fmt)}
        | {Capability("linear", fmt) for fmt in linear_fmts}
        | ({Capability("attention", "paged")} if full else set())
        | ({Capability("attention_sliding", "paged")} if sliding else set())
        | {Capability("rope", variant) for variant in ropes}
        | {Capability("rms_norm", "f32"), Capability("add_rms_norm", "f32"), Capability("silu_mul", "f32")}
    )
