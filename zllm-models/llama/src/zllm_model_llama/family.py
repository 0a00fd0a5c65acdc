"""The llama-style families: config -> spec, needed capabilities, tensor specs, model factory.

One layer code (:mod:`zllm_model_llama.model`) serves every family here; each family class
only names its HF ``model_type`` rules (:mod:`zllm_model_llama.spec`).
"""

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
from zllm_model_llama.model import LlamaModel
from zllm_model_llama.spec import (
    LLAMA,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    ArchRules,
    LlamaSpec,
    MoeSpec,
    spec_from_config,
)

LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


class LlamaFamily:
    """Factory for llama models (see :class:`zllm.domain.family.ModelFamily`)."""

    name = "llama"
    rules: ArchRules = LLAMA
    pipeline_stages = True
    """The layer code runs a contiguous range of layers (``parallel.pipeline``)."""

    def parse_config(self, config: dict[str, Any], source: str) -> LlamaSpec:
        return spec_from_config(config, source, self.rules)

    def tensor_specs(self, spec: LlamaSpec, parallel: ParallelContext = SINGLE) -> dict[str, TensorSpec]:
        """Every weight of ``spec``; with tensor parallelism, each with this rank's shard
        (:func:`tensor_shards`); with pipeline parallelism, the weights of other stages'
        layers (and the embedding, final norm and ``lm_head`` away from the first and last
        stage) marked ``elsewhere``.

        Raises:
            ConfigError: ``parallel.tensor`` does not fit the model (:func:`check_fits`).
        """
        check_fits(spec, parallel.tp_size)
        check_stage_windows(spec.layer_windows, parallel.pp_size)
        h, f, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
        vocab = parallel.padded_split(spec.vocab_size)
        last, mine = parallel.last_stage, parallel.stage_layers(spec.num_layers)
        embed_here = parallel.first_stage or (last and spec.tie_word_embeddings)
        specs = {
            "model.embed_tokens.weight": TensorSpec((spec.vocab_size, h), shard=vocab, elsewhere=not embed_here),
            "model.norm.weight": TensorSpec((h,), elsewhere=not last),
            # A tied checkpoint may still store lm_head.weight (equal to the embedding).
            "lm_head.weight": TensorSpec((spec.vocab_size, h), optional=spec.tie_word_embeddings, shard=vocab,
                                         elsewhere=not last),
        }
        shapes = {
            "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f),
        }
        shards = tensor_shards(spec, parallel)
        bias = {"self_attn.q_proj": spec.qkv_bias, "self_attn.k_proj": spec.qkv_bias, "self_attn.v_proj": spec.qkv_bias,
                "self_attn.o_proj": spec.o_bias, "mlp.gate_proj": spec.mlp_bias, "mlp.up_proj": spec.mlp_bias,
                "mlp.down_proj": spec.mlp_bias}
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            layer_specs = self._layer_specs(spec, i, shapes, bias, shards, parallel)
            specs |= {p + name: attrs.evolve(s, elsewhere=i not in mine) for name, s in layer_specs.items()}
        return specs

    def _layer_specs(self, spec: LlamaSpec, i: int, shapes: dict[str, tuple[int, int]], bias: dict[str, bool],
                     shards: dict[str, Shard], parallel: ParallelContext) -> dict[str, TensorSpec]:
        """Layer ``i``'s tensors, by name after ``model.layers.{i}.``."""
        h = spec.hidden_size
        specs = {"input_layernorm.weight": TensorSpec((h,)), "post_attention_layernorm.weight": TensorSpec((h,))}
        if spec.qk_norm:
            specs["self_attn.q_norm.weight"] = TensorSpec((spec.head_dim,))
            specs["self_attn.k_norm.weight"] = TensorSpec((spec.head_dim,))
        moe_layer = spec.moe is not None and spec.moe.moe_layers[i]
        for name, shape in shapes.items():
            if moe_layer and name.startswith("mlp."):
                continue
            shard = shards.get(name)
            specs[name + ".weight"] = TensorSpec(shape, shard=shard)
            if bias[name]:
                # A row-parallel layer's bias is added once, after the all-reduce.
                bias_shard = shard if shard is not None and shard.dim == 0 else None
                specs[name + ".bias"] = TensorSpec((shape[0],), shard=bias_shard)
        if moe_layer:
            assert spec.moe is not None
            specs |= _moe_tensor_specs(spec.moe, spec.moe.prefix + ".", h, parallel)
        return specs

    def required_capabilities(self, spec: LlamaSpec, weight_formats: dict[str, str]) -> frozenset[Capability]:
        embed_fmt = weight_formats["model.embed_tokens.weight"]
        head_fmt = weight_formats.get("lm_head.weight", embed_fmt) if not spec.tie_word_embeddings else embed_fmt
        linear_fmts = {fmt for name, fmt in weight_formats.items()
                       if ".experts." not in name and name.endswith(("_proj.weight", ".gate.weight"))} | {head_fmt}
        moe_fmts = set()
        if spec.moe is not None:
            for i, moe_layer in enumerate(spec.moe.moe_layers):
                if moe_layer:
                    moe_fmts.add(expert_layout(spec.moe, f"model.layers.{i}.{spec.moe.prefix}.", weight_formats)[1])
        return _capabilities(embed_fmt, linear_fmts, full=None in spec.layer_windows,
                             sliding=any(w is not None for w in spec.layer_windows), ropes={spec.rope_variant},
                             moe_fmts=moe_fmts)

    def format_capabilities(self, fmt: str) -> frozenset[Capability]:
        # The most any checkpoint of this family may need when all its weights are stored in
        # ``fmt`` (used by ``zllm compat``): a cell it calls declared never fails at load.
        # Both RoPE layouts: HF checkpoints rotate half-rotation pairs, GGUF llama files
        # adjacent pairs, in every format.
        return _capabilities(fmt, {fmt}, full=True, sliding=self.rules.sliding != "none", ropes={"neox", "gptj"},
                             moe_fmts={fmt} if self.rules.moe != "none" else set())

    def build(self, spec: LlamaSpec, weights: dict[str, Any], ops: Any,
              parallel: ParallelContext = SINGLE) -> LlamaModel:
        layouts: list[str | None] = [None] * spec.num_layers
        if spec.moe is not None:
            formats = {name: "" for name in weights}
            mine = parallel.stage_layers(spec.num_layers)
            for i, moe_layer in enumerate(spec.moe.moe_layers):
                if moe_layer and i in mine:
                    layouts[i] = expert_layout(spec.moe, f"model.layers.{i}.{spec.moe.prefix}.", formats)[0]
        return LlamaModel(spec, weights, ops, tuple(layouts), parallel)


def check_fits(spec: LlamaSpec, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model's heads or FFN widths cannot be split by.

    Raises:
        ConfigError: (``parallel.tensor``) names the setting, the model's number and the checkpoint.
    """
    if tp_size == 1:
        return
    source = spec.moe.source if spec.moe is not None and spec.moe.source else spec.model_type
    check_tensor_parallel(tp_size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, source=source)
    widths = {"intermediate_size": spec.intermediate_size}
    if spec.moe is not None:
        widths["expert width"] = spec.moe.expert_size
        if spec.moe.shared_size is not None:
            widths["shared expert width"] = spec.moe.shared_size
    for what, width in widths.items():
        if width % tp_size:
            raise ConfigError("parallel.tensor", f"{tp_size} does not divide the {what} {width} of {source}")


def tensor_shards(spec: LlamaSpec, parallel: ParallelContext) -> dict[str, Shard]:
    """This rank's slice of each projection of a decoder layer (none without tensor
    parallelism): Q and gate/up column-parallel (split by output rows: whole query heads and
    FFN rows), K and V by KV heads (:meth:`ParallelContext.kv_heads`: split or replicated),
    O and down row-parallel (split by input columns; the model all-reduces their output)."""
    if parallel.tp_size == 1:
        return {}
    d, f = spec.head_dim, spec.intermediate_size
    first, held = parallel.kv_heads(spec.num_heads, spec.num_kv_heads)
    kv = Shard(0, first * d, held * d)
    return {
        "self_attn.q_proj": parallel.split(spec.q_size), "self_attn.k_proj": kv, "self_attn.v_proj": kv,
        "self_attn.o_proj": parallel.split(spec.q_size, dim=1),
        "mlp.gate_proj": parallel.split(f), "mlp.up_proj": parallel.split(f), "mlp.down_proj": parallel.split(f, dim=1),
    }


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


class MixtralFamily(LlamaFamily):
    """Mixtral: Mistral's attention, a top-k softmax MoE FFN (always renormalised) on every layer."""

    name = "mixtral"
    rules = MIXTRAL


class Qwen2MoeFamily(LlamaFamily):
    """Qwen2-MoE: Qwen2's attention, MoE FFN plus a sigmoid-gated shared expert, dense layers
    where ``mlp_only_layers`` / ``decoder_sparse_step`` say."""

    name = "qwen2_moe"
    rules = QWEN2_MOE


class Qwen3MoeFamily(LlamaFamily):
    """Qwen3-MoE: Qwen3's attention (q/k norms), MoE FFN, dense layers as Qwen2-MoE."""

    name = "qwen3_moe"
    rules = QWEN3_MOE


#: Expert-weight layouts a checkpoint may store, each the tensors of one MoE layer (names after
#: the layer's FFN prefix): one tensor per expert (the hub's files, ``save_pretrained``),
#: transformers 5's fused ``gate_up_proj [E, 2N, K]`` + ``down_proj [E, K, N]``, or stacks
#: ``[E, N, K]`` / ``[E, K, N]`` per projection (GGUF ``ffn_{gate,up,down}_exps``).
EXPERT_LAYOUTS = ("per_expert", "fused", "stacked")


def _layout_shapes(moe: MoeSpec, hidden: int) -> dict[str, dict[str, tuple[int, ...]]]:
    e, n = moe.num_experts, moe.expert_size
    gate, up, down = moe.expert_names
    per_expert: dict[str, tuple[int, ...]] = {}
    for i in range(e):
        per_expert |= {f"experts.{i}.{gate}.weight": (n, hidden), f"experts.{i}.{up}.weight": (n, hidden),
                       f"experts.{i}.{down}.weight": (hidden, n)}
    return {
        "per_expert": per_expert,
        "fused": {"experts.gate_up_proj": (e, 2 * n, hidden), "experts.down_proj": (e, hidden, n)},
        "stacked": {f"experts.{gate}.weight": (e, n, hidden), f"experts.{up}.weight": (e, n, hidden),
                    f"experts.{down}.weight": (e, hidden, n)},
    }


def _moe_tensor_specs(moe: MoeSpec, p: str, hidden: int, parallel: ParallelContext) -> dict[str, TensorSpec]:
    """The router, every expert layout (optional: :func:`expert_layout` requires one whole)
    and the shared expert of one MoE layer whose FFN prefix is ``p``.

    With tensor parallelism every rank holds every expert, split by its intermediate
    dimension ``N`` (gate/up by rows, down by columns, as a dense FFN), and the router whole:
    each rank then does the same share of every token's work whatever the router picks,
    with the one all-reduce per layer a dense FFN has and no token exchange; splitting by
    expert would balance only as well as the routing does and needs an all-to-all. A fused
    ``gate_up_proj`` holds both halves in one tensor, so it is loaded whole (a file-mapped
    view) and each rank takes its rows of either half in :class:`~zllm_model_llama.model.MoeLayer`.
    """
    specs = {p + "gate.weight": TensorSpec((moe.num_experts, hidden))}
    tp = parallel.tp_size > 1
    down = moe.expert_names[2]
    for names in _layout_shapes(moe, hidden).values():
        for name, shape in names.items():
            # The N dimension: rows of gate/up ([N, C] or [E, N, C]), columns of down.
            is_down = name.endswith(f".{down}.weight") or name == "experts.down_proj"
            n_dim = len(shape) - 1 if is_down else len(shape) - 2
            shard = parallel.split(shape[n_dim], n_dim) if tp and not name.endswith("gate_up_proj") else None
            specs[p + name] = TensorSpec(shape, optional=True, shard=shard)
    if moe.shared_size is not None:
        s = moe.shared_size
        rows = parallel.split(s) if tp else None
        specs |= {p + "shared_expert.gate_proj.weight": TensorSpec((s, hidden), shard=rows),
                  p + "shared_expert.up_proj.weight": TensorSpec((s, hidden), shard=rows),
                  p + "shared_expert.down_proj.weight": TensorSpec((hidden, s),
                                                                   shard=parallel.split(s, 1) if tp else None),
                  p + "shared_expert_gate.weight": TensorSpec((1, hidden))}
    return specs


def expert_layout(moe: MoeSpec, p: str, present: dict[str, str]) -> tuple[str, str]:
    """``(layout, format)`` of the experts of the MoE layer with FFN prefix ``p``, from the
    checkpoint's tensors (``present``: name -> format), before any weight is read.

    Raises:
        CheckpointError: no layout is complete (names the first missing tensor), several are
            stored, or the experts' tensors are in more than one format.
    """
    hidden = 0  # shapes are checked by the tensor specs; only the names matter here
    layouts = {kind: [p + n for n in names] for kind, names in _layout_shapes(moe, hidden).items()}
    stored = [kind for kind, names in layouts.items() if any(n in present for n in names)]
    if not stored:
        raise CheckpointError(moe.source, f"tensor {layouts['per_expert'][0]!r} missing from the checkpoint "
                                          f"(the layer's experts are stored in no known layout: per expert, "
                                          f"fused gate_up_proj + down_proj, or stacked [E, N, K])")
    if len(stored) > 1:
        raise CheckpointError(moe.source, f"{p}experts are stored in several layouts ({', '.join(stored)}); "
                                          f"a checkpoint holds one")
    names = layouts[stored[0]]
    missing = [n for n in names if n not in present]
    if missing:
        raise CheckpointError(moe.source, f"tensor {missing[0]!r} missing from the checkpoint ({stored[0]} expert "
                                          f"layout, {moe.num_experts} experts ({moe.router.experts_key}))")
    formats = sorted({present[n] for n in names})
    if len(formats) > 1:
        raise CheckpointError(moe.source, f"{p}experts are stored in several formats ({', '.join(formats)})")
    return stored[0], formats[0]


def _capabilities(embed_fmt: str, linear_fmts: set[str], full: bool, sliding: bool,
                  ropes: set[str], moe_fmts: set[str]) -> frozenset[Capability]:
    """The one place that lists what a llama-style model needs: the weight ops in their
    formats (``moe`` in its experts' formats), the attention variants its layers use, the RoPE
    layouts, and the fixed math ops. Shared by
    ``required_capabilities`` and ``format_capabilities`` so the compatibility matrix and
    the load-time check cannot disagree."""
    return frozenset(
        {Capability("embedding", embed_fmt)}
        | {Capability("linear", fmt) for fmt in linear_fmts}
        | ({Capability("attention", "paged")} if full else set())
        | ({Capability("attention_sliding", "paged")} if sliding else set())
        | {Capability("rope", variant) for variant in ropes}
        | {Capability("moe", fmt) for fmt in moe_fmts}
        | {Capability("rms_norm", "f32"), Capability("add_rms_norm", "f32"), Capability("silu_mul", "f32")}
    )
