"""The gpt-oss family: config -> spec, needed capabilities, tensor specs, model factory."""

from __future__ import annotations

from typing import Any

import attrs

from zllm.plugin_api import (
    SINGLE,
    Capability,
    CheckpointError,
    ConfigError,
    ParallelContext,
    Shard,
    TensorSpec,
    check_stage_windows,
    check_tensor_parallel,
)
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

    pipeline_stages = True
    """The layer code runs a contiguous range of layers (``parallel.pipeline``)."""

    def tensor_specs(self, spec: GptOssSpec, parallel: ParallelContext = SINGLE) -> dict[str, TensorSpec]:
        """Every weight of ``spec``; with tensor parallelism each with this rank's shard
        (:func:`tensor_shards`); with pipeline stages, the weights of other stages' layers (and
        the embedding, final norm and ``lm_head`` away from the first and last stage) marked
        ``elsewhere``.

        Raises:
            ConfigError: ``parallel.tensor`` does not fit the heads or the expert width, or
                ``parallel.pipeline`` stages would mix sliding and full attention.
        """
        check_fits(spec, parallel.tp_size)
        check_stage_windows(spec.layer_windows, parallel.pp_size)
        c, v, q, kv = spec.hidden_size, spec.vocab_size, spec.q_size, spec.kv_size
        vocab = parallel.padded_split(v) if parallel.tp_size > 1 else None
        last, mine = parallel.last_stage, parallel.stage_layers(spec.num_layers)
        embed_here = parallel.first_stage or (last and spec.tie_word_embeddings)
        specs = {
            "model.embed_tokens.weight": TensorSpec((v, c), shard=vocab, elsewhere=not embed_here),
            "model.norm.weight": TensorSpec((c,), elsewhere=not last),
            "lm_head.weight": TensorSpec((v, c), optional=spec.tie_word_embeddings, shard=vocab, elsewhere=not last),
        }
        shapes = {"self_attn.q_proj": (q, c), "self_attn.k_proj": (kv, c), "self_attn.v_proj": (kv, c),
                  "self_attn.o_proj": (c, q)}
        shards = tensor_shards(spec, parallel)
        for i in range(spec.num_layers):
            layer = {"input_layernorm.weight": TensorSpec((c,)), "post_attention_layernorm.weight": TensorSpec((c,)),
                     "self_attn.sinks": TensorSpec((spec.num_heads,), shard=shards.get("self_attn.sinks"))}
            for name, shape in shapes.items():
                shard = shards.get(name)
                layer[name + ".weight"] = TensorSpec(shape, shard=shard)
                if spec.attention_bias:
                    # o_proj's bias (row-parallel) is whole: added once, on the first rank.
                    layer[name + ".bias"] = TensorSpec((shape[0],), shard=shard if name != "self_attn.o_proj" else None)
            layer["mlp.router.weight"] = TensorSpec((spec.num_experts, c))
            layer["mlp.router.bias"] = TensorSpec((spec.num_experts,))
            # Either layout; expert_layout() requires one whole before any weight is read.
            for names in _expert_shapes(spec).values():
                layer |= {f"mlp.experts.{name}": TensorSpec(shape, optional=True, shard=shards.get(name))
                          for name, shape in names.items()}
            p = f"model.layers.{i}."
            specs |= {p + name: attrs.evolve(s, elsewhere=i not in mine) for name, s in layer.items()}
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

    def build(self, spec: GptOssSpec, weights: dict[str, Any], ops: Any,
              parallel: ParallelContext = SINGLE) -> GptOssModel:
        present = {name: "" for name in weights}
        layouts = tuple(expert_layout(spec, f"model.layers.{i}.mlp.experts.", present)[0]
                        for i in parallel.stage_layers(spec.num_layers))
        return GptOssModel(spec, weights, ops, layouts, parallel)


def check_fits(spec: GptOssSpec, tp_size: int) -> None:
    """Refuse a tensor-parallel size the heads or the expert width cannot be split by.

    Raises:
        ConfigError: (``parallel.tensor``) names the setting, the model's number and the checkpoint.
    """
    if tp_size == 1:
        return
    source = spec.source or "gpt_oss"
    check_tensor_parallel(tp_size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, source=source)
    if spec.intermediate_size % tp_size:
        raise ConfigError("parallel.tensor", f"{tp_size} does not divide the intermediate_size "
                                             f"{spec.intermediate_size} of {source}")


def tensor_shards(spec: GptOssSpec, parallel: ParallelContext) -> dict[str, Shard]:
    """This rank's slice of each tensor of a decoder layer (none without tensor parallelism),
    by name after ``model.layers.{i}.`` for attention and after ``mlp.experts.`` for experts.

    Attention as the llama family: Q (and its bias) by whole query heads, with their sinks;
    K and V (and biases) by KV heads, split or replicated (:meth:`ParallelContext.kv_heads`);
    O row-parallel. Every expert is split by its width N, as DeepSeek's: gate/up rows (the
    fused ``gate_up_proj`` interleaves gate and up, so this rank's N share is one contiguous
    run of ``2 N / tp`` of its fused dimension), down columns; the down bias is whole (added
    once, on the first rank) and the router whole on every rank.
    """
    if parallel.tp_size == 1:
        return {}
    d, n = spec.head_dim, spec.intermediate_size
    first, held = parallel.kv_heads(spec.num_heads, spec.num_kv_heads)
    kv = Shard(0, first * d, held * d)
    part = parallel.split(n)
    fused = Shard(0, 2 * part.start, 2 * part.size)
    gate_up_dim, down_dim = (1, 2) if spec.experts_in_rows else (2, 1)  # [E, 2N, C] / [E, C, N], else x @ W
    return {
        "self_attn.q_proj": parallel.split(spec.q_size), "self_attn.k_proj": kv, "self_attn.v_proj": kv,
        "self_attn.o_proj": parallel.split(spec.q_size, dim=1), "self_attn.sinks": parallel.split(spec.num_heads),
        "gate_up_proj": attrs.evolve(fused, dim=gate_up_dim), "gate_up_proj_bias": attrs.evolve(fused, dim=1),
        "down_proj": attrs.evolve(part, dim=down_dim),
        "gate_proj.weight": attrs.evolve(part, dim=1), "up_proj.weight": attrs.evolve(part, dim=1),
        "down_proj.weight": attrs.evolve(part, dim=2),
        "gate_proj.bias": attrs.evolve(part, dim=1), "up_proj.bias": attrs.evolve(part, dim=1),
    }


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
