"""The frozen spec shared by the llama-style architectures, read from an HF-style config dict.

One decoder-layer code serves several HF ``model_type`` values; :class:`ArchRules` states, as
data, how each reads its config (transformers 5.24's ``configuration_*.py`` and
``modeling_*.py`` for that type):

============  ===================  =========  ==========  ===============  =====================
model_type    q/k/v bias           o bias     MLP bias    q/k RMSNorm      sliding window
============  ===================  =========  ==========  ===============  =====================
llama         ``attention_bias``   same       ``mlp_bias``  no             none
mistral       no                   no         no          no               every layer, when
                                                                           ``sliding_window`` set
qwen2         always               no         no          no               ``layer_types``
qwen3         ``attention_bias``   same       no          per head, [D]    ``layer_types``
============  ===================  =========  ==========  ===============  =====================

Qwen2/Qwen3 (``Qwen2Config.__post_init__``): the window is ``sliding_window`` only when
``use_sliding_window`` is true; ``layer_types`` defaults to ``sliding_attention`` for layers
``i >= max_window_layers`` (default 28) when a window is set, else ``full_attention``.
Mistral ignores ``layer_types`` (transformers only warns about it). ``head_dim`` defaults to
``hidden_size // num_attention_heads``, except Qwen3 whose config class defaults it to 128.

RoPE layout: HF checkpoints rotate pairs ``(i, i + D/2)`` of each head (``rope[neox]``). A
config with ``rope_interleaved: true`` — what zllm's GGUF reader reports for llama files, whose
Q/K rows llama.cpp's converter permuted into adjacent pairs — rotates pairs ``(2i, 2i + 1)``
(``rope[gptj]``, llama.cpp's ``LLAMA_ROPE_TYPE_NORM``) on the rows as stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from zllm.plugin_api import (
    CheckpointError,
    RopeParams,
    RouterConfig,
    config_flag,
    config_int,
    is_moe_layer,
    rope_params_from_config,
    router_config_from_hf,
)

FULL, SLIDING = "full_attention", "sliding_attention"


@attrs.frozen
class ArchRules:
    """How one HF ``model_type`` maps its config onto the shared llama layers.

    Bias fields are a config key (read, default False) or a constant.
    ``sliding``: ``none``, ``all`` (mistral) or ``layer_types`` (qwen2/qwen3).
    ``moe``: ``none`` (dense FFN), ``mixtral`` (``block_sparse_moe``, experts ``w1/w3/w2``
    of width ``intermediate_size``) or ``qwen`` (``mlp``, experts ``gate/up/down_proj`` of
    width ``moe_intermediate_size``, dense layers of ``intermediate_size``).
    ``shared_expert``: the MoE layers have Qwen2-MoE's gated shared expert.
    """

    model_type: str
    qkv_bias: str | bool
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool
    default_head_dim: int | None
    sliding: str
    moe: str = "none"
    shared_expert: bool = False


LLAMA = ArchRules("llama", "attention_bias", "attention_bias", "mlp_bias", False, None, "none")
MISTRAL = ArchRules("mistral", False, False, False, False, None, "all")
QWEN2 = ArchRules("qwen2", True, False, False, False, None, "layer_types")
QWEN3 = ArchRules("qwen3", "attention_bias", "attention_bias", False, True, 128, "layer_types")
# The MoE types: the attention of their dense counterpart (transformers' MixtralAttention,
# Qwen2MoeAttention, Qwen3MoeAttention are MistralAttention, Qwen2Attention with biases,
# Qwen3Attention with q/k norms); only the FFN differs.
MIXTRAL = ArchRules("mixtral", False, False, False, False, None, "all", moe="mixtral")
QWEN2_MOE = ArchRules("qwen2_moe", True, False, False, False, None, "layer_types", moe="qwen", shared_expert=True)
QWEN3_MOE = ArchRules("qwen3_moe", "attention_bias", "attention_bias", False, True, None, "layer_types", moe="qwen")


@attrs.frozen
class MoeSpec:
    """The Mixture-of-Experts FFN of a llama-style model.

    Attributes:
        router: routing settings (:func:`zllm.plugin_api.router_config_from_hf`).
        expert_size: width ``N`` of each routed expert.
        moe_layers: per layer, whether its FFN is the MoE block (else a dense SwiGLU FFN of
            ``intermediate_size``).
        prefix: the FFN's module name in HF checkpoints (``block_sparse_moe`` or ``mlp``).
        expert_names: HF names of an expert's gate, up and down projections.
        shared_size: width of Qwen2-MoE's gated shared expert, or None.
        source: the checkpoint, for errors found when the tensor layout is known.
    """

    router: RouterConfig
    expert_size: int
    moe_layers: tuple[bool, ...]
    prefix: str
    expert_names: tuple[str, str, str]
    shared_size: int | None = None
    source: str = attrs.field(default="", eq=False)

    @property
    def num_experts(self) -> int:
        return self.router.num_experts


@attrs.frozen
class LlamaSpec:
    """Dimensions and constants of one llama-style model. Units: counts of elements/tokens.

    ``layer_windows[i]`` is layer ``i``'s sliding window in tokens, or None for full attention.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeParams
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]
    rope_interleaved: bool = False
    moe: MoeSpec | None = None

    @property
    def rope_variant(self) -> str:
        """The ``rope`` capability variant: ``gptj`` for interleaved pairs, else ``neox``."""
        return "gptj" if self.rope_interleaved else "neox"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _flag(cfg: dict[str, Any], rule: str | bool, source: str) -> bool:
    """``rule`` if the architecture fixes it, else the config's ``rule`` key (absent or null: false)."""
    return rule if isinstance(rule, bool) else config_flag(cfg, rule, False, source)


def _layer_windows(cfg: dict[str, Any], rules: ArchRules, num_layers: int, context_length: int,
                   source: str) -> tuple[int | None, ...]:
    if rules.sliding == "none":
        return (None,) * num_layers
    if rules.sliding == "all":
        window = cfg.get("sliding_window")
        types = [SLIDING if window is not None else FULL] * num_layers
    else:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types") or [
            SLIDING if window is not None and i >= int(cfg.get("max_window_layers", 28)) else FULL
            for i in range(num_layers)
        ]
        if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
            raise CheckpointError(
                source, f"layer_types {types} is not supported: need {num_layers} entries, each {FULL!r} or {SLIDING!r}"
            )
        if SLIDING in types and window is None:
            raise CheckpointError(source, "layer_types has 'sliding_attention' but no window "
                                          "(use_sliding_window false or sliding_window unset)")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise CheckpointError(source, f"sliding_window {window!r} is not a positive integer")
    # A window covering the whole context window masks nothing: that layer is full attention.
    return tuple(window if t == SLIDING and window is not None and window < context_length else None for t in types)


def spec_from_config(cfg: dict[str, Any], source: str, rules: ArchRules = LLAMA) -> LlamaSpec:
    """Build a :class:`LlamaSpec` from an HF config dict of ``rules.model_type``.

    Raises:
        CheckpointError: a required key is missing, a value is inconsistent (heads not
            dividing), or a feature this family does not implement is configured (the
            message names it and what is supported).
    """
    def need(key: str) -> int:
        return config_int(cfg, key, source, model_type=rules.model_type)

    model_type = cfg.get("model_type", rules.model_type)
    if model_type != rules.model_type:
        raise CheckpointError(source,
                              f"model_type {model_type!r} is not {rules.model_type!r}, the type this family parses")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(source, f"hidden_act {cfg['hidden_act']!r} is not supported (supported: silu)")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise CheckpointError(source,
                              f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = config_int(cfg, "head_dim", source, rules.default_head_dim or hidden // heads)
    if head_dim % 2:
        raise CheckpointError(source, f"head_dim {head_dim} is odd; RoPE rotates pairs of dimensions")
    num_layers = need("num_hidden_layers")
    context_length = config_int(cfg, "max_position_embeddings", source, 2048)
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise CheckpointError(source, f"rms_norm_eps {eps!r} is not a finite number >= 0")
    try:
        rope = rope_params_from_config(cfg)
    except (ValueError, TypeError) as e:
        raise CheckpointError(source, str(e)) from None
    if rope.freq_factors is not None and len(rope.freq_factors) != head_dim // 2:
        raise CheckpointError(source, f"{len(rope.freq_factors)} RoPE frequency factors for head_dim {head_dim} "
                                      f"(need {head_dim // 2})")
    interleaved = cfg.get("rope_interleaved", False)
    if not isinstance(interleaved, bool):
        raise CheckpointError(source, f"rope_interleaved {interleaved!r} is not true or false")
    moe = _moe_spec(cfg, rules, num_layers, source, need)
    return LlamaSpec(
        model_type=rules.model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope=rope,
        context_length=context_length,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", source),
        qkv_bias=_flag(cfg, rules.qkv_bias, source),
        o_bias=_flag(cfg, rules.o_bias, source),
        mlp_bias=_flag(cfg, rules.mlp_bias, source),
        qk_norm=rules.qk_norm,
        layer_windows=_layer_windows(cfg, rules, num_layers, context_length, source),
        rope_interleaved=interleaved,
        moe=moe,
    )


def _moe_spec(cfg: dict[str, Any], rules: ArchRules, num_layers: int, source: str,
              need: Callable[[str], int]) -> MoeSpec | None:
    """The MoE part of the spec (None for a dense type); every key is read, none assumed
    (``norm_topk_prob`` included: Qwen3-MoE's config class defaults it to False while
    released checkpoints say True)."""
    if rules.moe == "none":
        return None
    try:
        router = router_config_from_hf({**cfg, "model_type": rules.model_type})
        moe_layers = tuple(is_moe_layer({**cfg, "model_type": rules.model_type}, i) for i in range(num_layers))
    except ValueError as e:
        raise CheckpointError(source, str(e)) from None
    mlp_only = cfg.get("mlp_only_layers") or []
    outside = [i for i in mlp_only if not 0 <= i < num_layers]
    if outside:
        raise CheckpointError(source, f"mlp_only_layers {mlp_only} names layer {outside[0]}, but the model has "
                                      f"{num_layers} layers (num_hidden_layers)")
    if rules.moe == "mixtral":
        return MoeSpec(router, need("intermediate_size"), moe_layers, "block_sparse_moe", ("w1", "w3", "w2"),
                       source=source)
    shared = need("shared_expert_intermediate_size") if rules.shared_expert else None
    return MoeSpec(router, need("moe_intermediate_size"), moe_layers, "mlp", ("gate_proj", "up_proj", "down_proj"),
                   shared, source=source)
