"""The gpt-oss family: config -> spec, needed capabilities, tensor specs, model factory."""

from __future__ import annotations

from typing import Any

from zllm.plugin_api import Capability, CheckpointError, TensorSpec
from zllm_model_gpt_oss.model import GptOssModel
from zllm_model_gpt_oss.spec import GptOssSpec, spec_from_config


def _expert_shapes(spec: GptOssSpec) -> dict[str, dict[str, tuple[int, ...]]]:
    """Per expert layout (:data:`~zllm_model_gpt_oss.model.EXPERT_LAYOUTS`), the tensors of one
    layer's experts by name after ``mlp.experts.``."""
    e, n, c = spec.num_experts, spec.intermediate_size, spec.hidden_size
    gate_up, down = ((e, 2 * n, c), (e, c, n)) if spec.experts_in_rows else ((e, c, 2 * n), (e, n, c))
    return {
        "fused": {"gate_up_proj": gate_up, "gate_up_proj_bias": (e, 2 * n), "down_proj": down,
                  "down_proj_bias": (e, c)},
        "stacked": {"gate_proj.weight": (e, n, c), "up_proj.weight": (e, n, c), "down_proj.weight": (e, c, n),
                    "gate_proj.bias": (e, n), "up_proj.bias": (e, n), "down_proj.bias": (e, c)},
    }


def expert_layout(spec: GptOssSpec, p: str, present: dict[str, str]) -> tuple[str, str]:
    """``(layout, format)`` of the experts under ``p`` (``model.layers.{i}.mlp.experts.``) from
    the checkpoint's tensors (``present``: name -> format), before any weight is read.

    Raises:
        CheckpointError: no layout is complete (names the first missing tensor), both are
            stored, or the expert weights are in more than one format.
    """
    layouts = {kind: [p + name for name in names] for kind, names in _expert_shapes(spec).items()}
    stored = [kind for kind, names in layouts.items() if any(n in present for n in names)]
    if len(stored) > 1:
        raise CheckpointError(spec.source, f"{p[:-1]} is stored in both the fused and the stacked layout; a checkpoint "
                                      "holds one")
    kind = stored[0] if stored else "fused"
    missing = [n for n in layouts[kind] if n not in present]
    if missing:
        raise CheckpointError(spec.source, f"tensor {missing[0]!r} missing from the checkpoint ({kind} expert layout)")
    formats = sorted({present[n] for n in layouts[kind] if not n.endswith(("bias", "_bias"))})
    if len(formats) > 1:
        raise CheckpointError(spec.source, f"{p[:-1]} weights are stored in several formats ({', '.join(formats)})")
    return kind, formats[0]


class GptOssFamily:
    """Factory for gpt-oss models (see :class:`zllm.domain.family.ModelFamily`)."""

    name = "gpt_oss"

    def parse_config(self, config: dict[str, Any], source: str) -> GptOssSpec:
        return spec_from_config(config, source)

    def tensor_specs(self, spec: GptOssSpec) -> dict[str, TensorSpec]:
        c, v, q, kv = spec.hidden_size, spec.vocab_size, spec.q_size, spec.kv_size
        specs = {
            "model.embed_tokens.weight": TensorSpec((v, c)),
            "model.norm.weight": TensorSpec((c,)),
            "lm_head.weight": TensorSpec((v, c), optional=spec.tie_word_embeddings),
        }
        shapes = {"self_attn.q_proj": (q, c), "self_attn.k_proj": (kv, c), "self_attn.v_proj": (kv, c),
                  "self_attn.o_proj": (c, q)}
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            specs[p + "input_layernorm.weight"] = TensorSpec((c,))
            specs[p + "post_attention_layernorm.weight"] = TensorSpec((c,))
            specs[p + "self_attn.sinks"] = TensorSpec((spec.num_heads,))
            for name, shape in shapes.items():
                specs[p + name + ".weight"] = TensorSpec(shape)
                if spec.attention_bias:
                    specs[p + name + ".bias"] = TensorSpec((shape[0],))
            specs[p + "mlp.router.weight"] = TensorSpec((spec.num_experts, c))
            specs[p + "mlp.router.bias"] = TensorSpec((spec.num_experts,))
            # Either layout; expert_layout() requires one whole before any weight is read.
            for names in _expert_shapes(spec).values():
                specs |= {f"{p}mlp.experts.{name}": TensorSpec(shape, optional=True) for name, shape in names.items()}
        return specs

    def required_capabilities(self, spec: GptOssSpec, weight_formats: dict[str, str]) -> frozenset[Capability]:
        embed_fmt = weight_formats["model.embed_tokens.weight"]
        head_fmt = embed_fmt if spec.tie_word_embeddings else weight_formats.get("lm_head.weight", embed_fmt)
        linear_fmts = {head_fmt} | {fmt for name, fmt in weight_formats.items()
                                    if name.endswith(("_proj.weight", "router.weight")) and ".experts." not in name}
        expert_fmts = {expert_layout(spec, f"model.layers.{i}.mlp.experts.", weight_formats)[1]
                       for i in range(spec.num_layers)}
        return _capabilities(embed_fmt, linear_fmts, expert_fmts)

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        # The most any checkpoint of this family needs with every weight in ``fmt`` (``zllm compat``).
        return _capabilities(fmt, {fmt}, {fmt})

    def build(self, spec: GptOssSpec, weights: dict[str, Any], ops: Any) -> GptOssModel:
        present = {name: "" for name in weights}
        layouts = tuple(expert_layout(spec, f"model.layers.{i}.mlp.experts.", present)[0]
                        for i in range(spec.num_layers))
        return GptOssModel(spec, weights, ops, layouts)


def _capabilities(embed_fmt: str, linear_fmts: set[str], expert_fmts: set[str]) -> frozenset[Capability]:
    """The one place that lists what a gpt-oss model needs, shared by ``required_capabilities``
    and ``format_capabilities`` so the compatibility matrix and the load-time check agree.
    Attention with sinks serves both the sliding and the full layers (its ``window`` argument)."""
    return frozenset(
        {Capability("embedding", embed_fmt)}
        | {Capability("linear", fmt) for fmt in linear_fmts}
        | {Capability("moe_clamped_swiglu", fmt) for fmt in expert_fmts}
        | {
            Capability("attention_sinks", "paged"),
            Capability("rope", "neox"),
            Capability("router_topk_softmax", "f32"),
            Capability("rms_norm", "f32"),
            Capability("add_rms_norm", "f32"),
        }
    )
