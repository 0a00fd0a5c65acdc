"""The DeepSeek family: config -> spec, needed capabilities, tensor specs, model factory."""

from __future__ import annotations

from typing import Any

import attrs

from zllm.plugin_api import SINGLE, Capability, ConfigError, ParallelContext, Shard, TensorSpec, check_tensor_parallel
from zllm_model_deepseek.model import DeepseekModel
from zllm_model_deepseek.spec import DeepseekSpec, spec_from_config

#: MTP tensors besides a decoder layer's (DeepSeek-V3 ``model.layers.{L}.*``).
MTP_EXTRA = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")


def _attention_specs(spec: DeepseekSpec, optional: bool, parallel: ParallelContext) -> dict[str, TensorSpec]:
    """``self_attn.*`` tensors of one layer, by name after ``model.layers.{i}.``.

    With tensor parallelism each rank holds ``H / tp`` heads: the rows of ``q_proj`` /
    ``q_b_proj`` and ``kv_b_proj`` of its heads (``k_b_proj`` / ``v_b_proj`` by their head
    dimension), ``o_proj``'s columns of them (row-parallel); the latent projections
    (``q_a_proj``, ``kv_a_proj_with_mqa``) are whole on every rank, so every rank computes
    and caches the same latent row (the latent cache is replicated: it has no heads to split)."""
    m, k = spec.mla, spec.hidden_size
    h, dn, dr, dv, r = (
        m.num_heads,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    )
    specs: dict[str, tuple[int, ...]] = {
        "self_attn.kv_a_proj_with_mqa.weight": (r + dr, k),
        "self_attn.kv_a_layernorm.weight": (r,),
        "self_attn.o_proj.weight": (k, h * dv),
    }
    if m.q_lora_rank is None:
        specs["self_attn.q_proj.weight"] = (h * (dn + dr), k)
    else:
        specs |= {
            "self_attn.q_a_proj.weight": (m.q_lora_rank, k),
            "self_attn.q_a_layernorm.weight": (m.q_lora_rank,),
            "self_attn.q_b_proj.weight": (h * (dn + dr), m.q_lora_rank),
        }
    if spec.attention_bias:
        specs |= {"self_attn.kv_a_proj_with_mqa.bias": (r + dr,), "self_attn.o_proj.bias": (k,)}
        if m.q_lora_rank is not None:
            specs["self_attn.q_a_proj.bias"] = (m.q_lora_rank,)
    tp = parallel.tp_size > 1
    shards: dict[str, Shard | None] = {
        "self_attn.q_proj.weight": parallel.split(h * (dn + dr)) if tp else None,
        "self_attn.q_b_proj.weight": parallel.split(h * (dn + dr)) if tp else None,
        "self_attn.o_proj.weight": parallel.split(h * dv, dim=1) if tp else None,
        "self_attn.k_b_proj.weight": parallel.split(h) if tp else None,
        "self_attn.v_b_proj.weight": parallel.split(h) if tp else None,
        "self_attn.kv_b_proj.weight": parallel.split(h * (dn + dv)) if tp else None,
    }
    out = {name: TensorSpec(shape, optional=optional, shard=shards.get(name)) for name, shape in specs.items()}
    if spec.kv_b_split:
        # Any format: re-joined into kv_b_proj at load (model._kv_b), decoded if quantized.
        out["self_attn.k_b_proj.weight"] = TensorSpec((h, r, dn), optional=optional,
                                                      shard=shards["self_attn.k_b_proj.weight"])
        out["self_attn.v_b_proj.weight"] = TensorSpec((h, dv, r), optional=optional,
                                                      shard=shards["self_attn.v_b_proj.weight"])
    else:
        out["self_attn.kv_b_proj.weight"] = TensorSpec((h * (dn + dv), r), optional=optional,
                                                       shard=shards["self_attn.kv_b_proj.weight"])
    return out


def _ffn_specs(spec: DeepseekSpec, moe: bool, optional: bool, parallel: ParallelContext) -> dict[str, TensorSpec]:
    """``mlp.*`` tensors of one layer, by name after ``model.layers.{i}.``.

    With tensor parallelism a dense FFN, every routed expert and the shared experts are split
    by their intermediate dimension (gate/up rows, down columns) and the router is whole on
    every rank — experts are not distributed across ranks (expert parallelism): each rank does
    the same share of every token's work whatever the router picks, with the one all-reduce a
    dense FFN has and no token exchange."""
    k = spec.hidden_size
    if not moe:
        f = spec.intermediate_size
        dense = {
            "mlp.gate_proj.weight": (f, k),
            "mlp.up_proj.weight": (f, k),
            "mlp.down_proj.weight": (k, f),
        }
        return {name: TensorSpec(shape, optional=optional, shard=_ffn_shard(name, shape, parallel))
                for name, shape in dense.items()}
    e, n, ns = spec.num_experts, spec.moe_intermediate_size, spec.shared_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (e, k)}
    if spec.model_type == "deepseek_v3":
        shapes["mlp.gate.e_score_correction_bias"] = (e,)
    if spec.experts_stacked:
        shapes |= {
            "mlp.experts.gate_proj": (e, n, k),
            "mlp.experts.up_proj": (e, n, k),
            "mlp.experts.down_proj": (e, k, n),
        }
    else:
        for x in range(e):
            shapes |= {
                f"mlp.experts.{x}.gate_proj.weight": (n, k),
                f"mlp.experts.{x}.up_proj.weight": (n, k),
                f"mlp.experts.{x}.down_proj.weight": (k, n),
            }
    if ns:
        shapes |= {
            "mlp.shared_experts.gate_proj.weight": (ns, k),
            "mlp.shared_experts.up_proj.weight": (ns, k),
            "mlp.shared_experts.down_proj.weight": (k, ns),
        }
    return {name: TensorSpec(shape, optional=optional, shard=_ffn_shard(name, shape, parallel))
            for name, shape in shapes.items()}


def _ffn_shard(name: str, shape: tuple[int, ...], parallel: ParallelContext) -> Shard | None:
    """This rank's slice of an FFN weight: the intermediate dimension of a gate/up (rows) or
    down (columns) projection, dense, expert or shared; None for the router and without TP."""
    if parallel.tp_size == 1 or name.startswith("mlp.gate."):
        return None
    dim = len(shape) - 1 if "down_proj" in name else len(shape) - 2
    return parallel.split(shape[dim], dim)


def check_fits(spec: DeepseekSpec, tp_size: int) -> None:
    """Refuse a tensor-parallel size the heads or FFN widths cannot be split by.

    Raises:
        ConfigError: (``parallel.tensor``) names the setting and the model's number.
    """
    if tp_size == 1:
        return
    source = spec.model_type
    check_tensor_parallel(tp_size, num_heads=spec.mla.num_heads, num_kv_heads=spec.mla.num_heads, source=source)
    widths = {"intermediate_size": spec.intermediate_size, "moe_intermediate_size": spec.moe_intermediate_size,
              "shared experts' width": spec.shared_intermediate_size}
    for what, width in widths.items():
        if width and width % tp_size:
            raise ConfigError("parallel.tensor", f"{tp_size} does not divide the {what} {width} of {source}")


class DeepseekFamily:
    """Factory for DeepSeek-V2/V3 models (see :class:`zllm.domain.family.ModelFamily`)."""

    name = "deepseek"
    pipeline_stages = True
    """The layer code runs a contiguous range of layers (``parallel.pipeline``)."""

    def parse_config(self, config: dict[str, Any], source: str) -> DeepseekSpec:
        return spec_from_config(config, source)

    def tensor_specs(self, spec: DeepseekSpec, parallel: ParallelContext = SINGLE) -> dict[str, TensorSpec]:
        """Every weight; with tensor parallelism each with this rank's shard (heads, FFN
        widths, vocabulary rows). MTP layers are sharded as decoder layers but not run then
        (speculative decoding runs on one rank). With pipeline stages, the weights of other
        stages' layers (and the embedding, final norm and ``lm_head`` away from the first and
        last stage) are marked ``elsewhere``, and so are the MTP layers on every stage: no
        stage runs them.

        Raises:
            ConfigError: ``parallel.tensor`` does not fit the model (:func:`check_fits`).
        """
        check_fits(spec, parallel.tp_size)
        k, v = spec.hidden_size, spec.vocab_size
        vocab = parallel.padded_split(v) if parallel.tp_size > 1 else None
        last, mine = parallel.last_stage, parallel.stage_layers(spec.num_layers)
        embed_here = parallel.first_stage or (last and spec.tie_word_embeddings)
        specs = {
            "model.embed_tokens.weight": TensorSpec((v, k), shard=vocab, elsewhere=not embed_here),
            "model.norm.weight": TensorSpec((k,), elsewhere=not last),
            # A tied checkpoint may still store lm_head.weight (equal to the embedding).
            "lm_head.weight": TensorSpec((v, k), optional=spec.tie_word_embeddings, shard=vocab, elsewhere=not last),
        }
        layers = [(i, moe, False) for i, moe in enumerate(spec.moe_layers)]
        # MTP layers: loaded when present, never required (transformers drops them on save).
        layers += [(spec.num_layers + j, True, True) for j in range(spec.num_nextn_predict_layers)]
        for i, moe, optional in layers:
            p = f"model.layers.{i}."
            layer = {"input_layernorm.weight": TensorSpec((k,), optional=optional),
                     "post_attention_layernorm.weight": TensorSpec((k,), optional=optional)}
            layer |= _attention_specs(spec, optional, parallel)
            layer |= _ffn_specs(spec, moe and spec.router is not None, optional, parallel)
            if optional:
                mtp = {"enorm": (k,), "hnorm": (k,), "eh_proj": (k, 2 * k), "shared_head.norm": (k,),
                       "shared_head.head": (v, k), "embed_tokens": (v, k)}
                layer |= {f"{name}.weight": TensorSpec(mtp[name], optional=True) for name in MTP_EXTRA}
            here = i in mine or (optional and parallel.pp_size == 1)
            specs |= {p + name: attrs.evolve(s, elsewhere=not here) for name, s in layer.items()}
        return specs

    def required_capabilities(
        self, spec: DeepseekSpec, weight_formats: dict[str, str]
    ) -> frozenset[Capability]:
        embed_fmt = weight_formats["model.embed_tokens.weight"]
        head_fmt = (
            embed_fmt
            if spec.tie_word_embeddings
            else weight_formats.get("lm_head.weight", embed_fmt)
        )
        # The MTP layers' tensors count when stored (weight_formats holds stored tensors only).
        decoder = [f"model.layers.{i}." for i in range(spec.num_layers + spec.num_nextn_predict_layers)]
        mtp_heads = {
            fmt for name, fmt in weight_formats.items() if name.endswith("shared_head.head.weight")
        }
        linear_fmts = {head_fmt} | mtp_heads | {
            fmt
            for name, fmt in weight_formats.items()
            if any(name.startswith(p) for p in decoder)
            and name.endswith("_proj.weight")
            and ".experts." not in name
            and not name.endswith(("k_b_proj.weight", "v_b_proj.weight", "kv_b_proj.weight"))
        }
        expert_fmts = {
            fmt
            for name, fmt in weight_formats.items()
            if any(name.startswith(p + "mlp.experts.") for p in decoder)
        }
        return _capabilities(embed_fmt, linear_fmts, expert_fmts, ropes={spec.rope_variant})

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        # The most any checkpoint of this family may need with every weight in ``fmt`` (for
        # ``zllm compat``): both RoPE layouts (deepseek_v3's rope_interleave false rotates
        # half-split pairs) and MoE layers.
        return _capabilities(fmt, {fmt}, {fmt}, ropes={"gptj", "neox"})

    def build(self, spec: DeepseekSpec, weights: dict[str, Any], ops: Any,
              parallel: ParallelContext = SINGLE) -> DeepseekModel:
        return DeepseekModel(spec, weights, ops, parallel)


def _capabilities(
    embed_fmt: str, linear_fmts: set[str], expert_fmts: set[str], ropes: set[str]
) -> frozenset[Capability]:
    """The one place that lists what a DeepSeek model needs, shared by ``required_capabilities``
    and ``format_capabilities`` so the compatibility matrix and the load-time check agree.
    ``kv_b_proj`` is read by ``mla_attention`` itself, in any format; the router's logits
    come from an f32 copy of its weight (router math stays f32)."""
    router_fmts = {"f32"} if expert_fmts else set()
    return frozenset(
        {Capability("embedding", embed_fmt)}
        | {Capability("linear", fmt) for fmt in linear_fmts | router_fmts}
        | {Capability("moe", fmt) for fmt in expert_fmts}
        | {Capability("rope", variant) for variant in ropes}
        | {
            Capability("mla_attention", "paged"),
            Capability("rms_norm", "f32"),
            Capability("add_rms_norm", "f32"),
            Capability("silu_mul", "f32"),
        }
    )
