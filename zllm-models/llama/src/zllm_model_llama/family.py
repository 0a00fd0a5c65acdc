"""The llama family: config -> spec, needed capabilities, tensor specs, model factory."""

from __future__ import annotations

from typing import Any

from zllm.plugin_api import Capability, TensorSpec
from zllm_model_llama.model import LlamaModel
from zllm_model_llama.spec import LlamaSpec, spec_from_config

LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


class LlamaFamily:
    """Factory for llama models (see :class:`zllm.domain.family.ModelFamily`)."""

    name = "llama"

    def parse_config(self, config: dict[str, Any], source: str) -> LlamaSpec:
        return spec_from_config(config, source)

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
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            specs[p + "input_layernorm.weight"] = TensorSpec((h,))
            specs[p + "post_attention_layernorm.weight"] = TensorSpec((h,))
            for name, shape in shapes.items():
                specs[p + name + ".weight"] = TensorSpec(shape)
                has_bias = spec.attention_bias if name.startswith("self_attn") else spec.mlp_bias
                if has_bias:
                    specs[p + name + ".bias"] = TensorSpec((shape[0],))
        return specs

    def required_capabilities(self, spec: LlamaSpec, weight_formats: dict[str, str]) -> frozenset[Capability]:
        embed_fmt = weight_formats["model.embed_tokens.weight"]
        head_fmt = weight_formats.get("lm_head.weight", embed_fmt) if not spec.tie_word_embeddings else embed_fmt
        linear_fmts = {fmt for name, fmt in weight_formats.items() if name.endswith("_proj.weight")} | {head_fmt}
        return _capabilities(embed_fmt, linear_fmts)

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        # Every llama needs the same ops whatever its size, so a checkpoint whose weights
        # are all stored in ``fmt`` needs exactly this set (used by ``zllm compat``).
        return _capabilities(fmt, {fmt})

    def build(self, spec: LlamaSpec, weights: dict[str, Any], ops: Any) -> LlamaModel:
        return LlamaModel(spec, weights, ops)


def _capabilities(embed_fmt: str, linear_fmts: set[str]) -> frozenset[Capability]:
    """The one place that lists what a llama needs: the weight ops in their formats plus the
    fixed math ops. Shared by ``required_capabilities`` and ``format_capabilities`` so the
    compatibility matrix and the load-time check cannot disagree."""
    return frozenset(
        {Capability("embedding", embed_fmt)}
        | {Capability("linear", fmt) for fmt in linear_fmts}
        | {Capability("rms_norm", "f32"), Capability("rope", "neox"), Capability("attention", "paged"),
           Capability("silu_mul", "f32"), Capability("sample", "f32")}
    )
