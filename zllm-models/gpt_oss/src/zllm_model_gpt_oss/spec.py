"""The frozen spec of a gpt-oss model, read from an HF-style config dict.

Keys and defaults are transformers 5.24's ``GptOssConfig`` (``configuration_gpt_oss.py``):
``head_dim`` 64, ``num_key_value_heads`` = heads when null, ``sliding_window`` 128,
``attention_bias`` true, ``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0, ``rms_norm_eps`` 1e-5,
``layer_types`` alternating ``sliding_attention`` (even layers) and ``full_attention`` (odd
layers) when null, and YaRN RoPE (factor 32 over 4096 positions, beta 32 / 1, no
truncation, theta 150000) when ``rope_parameters`` is null. Every expert is ``intermediate_size``
wide; every layer is a MoE layer of ``num_local_experts`` experts, ``num_experts_per_tok``
per token.

A checkpoint with ``quantization_config.quant_method: mxfp4`` (the released gpt-oss files) has
its fused expert tensors folded by the weights layer into the weight-format registry's row
layout, ``[E, rows, in-features]``: ``gate_up_proj [E, 2N, C]`` (the blocks' rows, gate even)
and ``down_proj [E, C, N]``, where transformers' dense parameters are ``[E, C, 2N]`` and
``[E, N, C]`` (``x @ W``); :attr:`GptOssSpec.experts_in_rows` says which the model reads.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from zllm.plugin_api import CheckpointError, RopeParams, config_flag, config_int, rope_params_from_config

FULL, SLIDING = "full_attention", "sliding_attention"

#: ``rope_parameters`` of a config that has none (``GptOssConfig.__post_init__``).
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


@attrs.frozen
class GptOssSpec:
    """Dimensions and constants of one gpt-oss model. Units: counts of elements/tokens.

    ``layer_windows[i]`` is layer ``i``'s sliding window in tokens, or None for full attention;
    ``experts_in_rows``: the fused expert tensors are in row layout (MXFP4 experts, ``quant_method: mxfp4``);
    ``source`` is the checkpoint, for errors found once the tensor layout is known.
    """

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
    attention_bias: bool
    layer_windows: tuple[int | None, ...]
    num_experts: int
    experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float
    experts_in_rows: bool = False
    source: str = attrs.field(default="", eq=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def spec_from_config(cfg: dict[str, Any], source: str) -> GptOssSpec:
    """Build a :class:`GptOssSpec` from a ``gpt_oss`` config dict.

    Raises:
        CheckpointError: a required key is missing or mistyped, a value is inconsistent (heads
            not dividing, more experts per token than experts), or a feature this family does
            not implement is configured; the message names the key.
    """
    def need(key: str) -> int:
        return config_int(cfg, key, source, model_type="gpt_oss")

    def number(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckpointError(source, f"{key} {value!r} is not a finite number")
        return float(value)

    if cfg.get("model_type", "gpt_oss") != "gpt_oss":
        raise CheckpointError(source, f"model_type {cfg['model_type']!r} is not 'gpt_oss', the type this family parses")
    heads = need("num_attention_heads")
    kv_heads = config_int(cfg, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise CheckpointError(source,
                              f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = config_int(cfg, "head_dim", source, 64)
    if head_dim % 2:
        raise CheckpointError(source, f"head_dim {head_dim} is odd; RoPE rotates pairs of dimensions")
    num_layers = need("num_hidden_layers")
    context_length = config_int(cfg, "max_position_embeddings", source, 131072)
    experts, per_tok = need("num_local_experts"), need("num_experts_per_tok")
    if per_tok > experts:
        raise CheckpointError(source, f"num_experts_per_tok {per_tok} > num_local_experts {experts}: a token "
                                      "cannot pick more experts than exist")
    limit = number("swiglu_limit", 7.0)
    if limit <= 0:
        raise CheckpointError(source, f"swiglu_limit {limit} is not > 0")
    eps = number("rms_norm_eps", 1e-5)
    if eps < 0:
        raise CheckpointError(source, f"rms_norm_eps {eps} is not >= 0")
    try:
        rope = rope_params_from_config(cfg if cfg.get("rope_parameters") or cfg.get("rope_scaling")
                                       else {**cfg, "rope_parameters": DEFAULT_ROPE})
    except (ValueError, TypeError) as e:
        raise CheckpointError(source, str(e)) from None
    return GptOssSpec(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope=rope,
        context_length=context_length,
        tie_word_embeddings=config_flag(cfg, "tie_word_embeddings", False, source),
        attention_bias=config_flag(cfg, "attention_bias", True, source),
        layer_windows=_layer_windows(cfg, num_layers, context_length, source),
        num_experts=experts,
        experts_per_tok=per_tok,
        swiglu_alpha=number("swiglu_alpha", 1.702),
        swiglu_limit=limit,
        experts_in_rows=_mxfp4_experts(cfg),
        source=source,
    )


def _mxfp4_experts(cfg: dict[str, Any]) -> bool:
    """Whether the fused experts are stored as MXFP4 blocks (``quant_method: mxfp4``), which fold
    into the row layout. Another method (FP8, compressed-tensors) quantizes only ``Linear``
    modules and leaves the fused expert parameters dense, in transformers' ``x @ W`` layout."""
    qconfig = cfg.get("quantization_config")
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == "mxfp4"


def _layer_windows(cfg: dict[str, Any], num_layers: int, context_length: int, source: str) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window", 128)
    types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise CheckpointError(source, f"layer_types {types} is not supported: need {num_layers} entries, "
                                      f"each {FULL!r} or {SLIDING!r}")
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(source, f"sliding_window {window!r} is not a positive integer "
                                      "(layer_types has 'sliding_attention')")
    # A window covering the whole context masks nothing: that layer is full attention.
    return tuple(window if t == SLIDING and window < context_length else None for t in types)
