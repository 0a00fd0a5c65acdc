"""The frozen spec of a DeepSeek-V2/V3 model, read from an HF-style config dict.

Config semantics follow transformers 5's ``DeepseekV2Config`` / ``DeepseekV3Config`` and
their modeling code; the attention settings are read by the core's
:func:`~zllm.plugin_api.mla_config_from_hf` and the routing settings by
:func:`~zllm.plugin_api.router_config_from_hf` (one reading of each key for every user):

- attention: Multi-head Latent Attention (``q_lora_rank`` null or set, ``kv_lora_rank``
  required, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), RoPE on the rope
  part only — adjacent pairs for ``deepseek_v2`` always and for ``deepseek_v3`` when
  ``rope_interleave`` (default true), half-split pairs otherwise — with DeepSeek's YaRN
  (``mscale``, ``mscale_all_dim``);
- FFN: layers ``0 .. first_k_dense_replace - 1`` dense (``intermediate_size``), the others
  MoE (``n_routed_experts`` of width ``moe_intermediate_size``, ``n_shared_experts`` always on);
- Multi-token-prediction layers (``num_nextn_predict_layers``, layer indices after the last
  decoder layer): their tensors are accepted and loaded when a checkpoint carries them; the
  first one is the model's ``mtp`` proposer for speculative decoding
  (:mod:`zllm_model_deepseek.mtp`).

Two zllm keys describe a GGUF file's layout (:mod:`zllm_model_deepseek.gguf` sets them):
``kv_b_split`` (``kv_b_proj`` stored as per-head ``k_b_proj`` transposed and ``v_b_proj``) and
``experts_stacked`` (expert weights stored as ``[E, N, K]`` stacks, not per expert).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from zllm.plugin_api import (
    CheckpointError,
    MlaConfig,
    RopeParams,
    RouterConfig,
    config_flag,
    config_int,
    is_moe_layer,
    mla_config_from_hf,
    router_config_from_hf,
)

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@attrs.frozen
class DeepseekSpec:
    """Dimensions and constants of one DeepSeek model. Units: counts of elements/tokens.

    Attributes:
        mla: the attention shapes and softmax scale (``hidden_size``, heads, ranks, head dims).
        rope: RoPE over the ``qk_rope_head_dim`` rope part.
        moe_layers: per decoder layer, whether its FFN is MoE (else dense).
        router: the routing of every MoE layer; None when no layer is MoE.
        shared_intermediate_size: ``n_shared_experts * moe_intermediate_size`` (0: none).
        num_nextn_predict_layers: MTP layers a checkpoint may carry after the decoder layers.
        attention_bias: ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` carry biases.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    mla: MlaConfig
    rope: RopeParams
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    moe_layers: tuple[bool, ...]
    router: RouterConfig | None
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_nextn_predict_layers: int
    kv_b_split: bool = False
    experts_stacked: bool = False

    @property
    def rope_variant(self) -> str:
        """The ``rope`` capability variant: ``gptj`` for adjacent pairs, else ``neox``."""
        return "gptj" if self.mla.rope_interleave else "neox"

    @property
    def num_experts(self) -> int:
        return 0 if self.router is None else self.router.num_experts


def spec_from_config(cfg: dict[str, Any], source: str) -> DeepseekSpec:
    """Build a :class:`DeepseekSpec` from an HF config dict of ``deepseek_v2``/``deepseek_v3``.

    Raises:
        CheckpointError: a required key is missing (``kv_lora_rank`` ...), a value is bad or
            settings contradict each other (``topk_group > n_group`` ...), or a feature this
            family does not implement is configured; the message names the key.
    """
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            source, f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
        )

    def positive_int(key: str, default: int | None = None) -> int:
        return config_int(cfg, key, source, default, model_type=str(model_type))

    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            source, f"hidden_act {cfg['hidden_act']!r} is not supported (supported: silu)"
        )
    try:
        mla, rope = mla_config_from_hf(cfg)
    except (ValueError, TypeError) as e:
        raise CheckpointError(source, str(e)) from None
    num_layers = positive_int("num_hidden_layers")
    try:
        moe_layers = tuple(is_moe_layer(cfg, i) for i in range(num_layers))
        router = router_config_from_hf(cfg) if any(moe_layers) else None
    except (ValueError, TypeError) as e:
        raise CheckpointError(source, str(e)) from None
    moe_width = (
        positive_int("moe_intermediate_size")
        if router is not None
        else int(cfg.get("moe_intermediate_size") or 0)
    )
    n_shared = cfg.get("n_shared_experts") or 0
    if isinstance(n_shared, bool) or not isinstance(n_shared, int) or n_shared < 0:
        raise CheckpointError(source, f"n_shared_experts {n_shared!r} is not an integer >= 0")
    mtp = cfg.get("num_nextn_predict_layers") or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise CheckpointError(source, f"num_nextn_predict_layers {mtp!r} is not an integer >= 0")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise CheckpointError(source, f"rms_norm_eps {eps!r} is not a finite number >= 0")
    flags = {key: config_flag(cfg, key, False, source)
             for key in ("tie_word_embeddings", "attention_bias", "kv_b_split", "experts_stacked")}
    return DeepseekSpec(
        model_type=model_type,
        vocab_size=positive_int("vocab_size"),
        hidden_size=mla.hidden_size,
        intermediate_size=positive_int("intermediate_size"),
        num_layers=num_layers,
        mla=mla,
        rope=rope,
        rms_norm_eps=float(eps),
        context_length=positive_int("max_position_embeddings", 2048),
        moe_layers=moe_layers,
        router=router,
        moe_intermediate_size=moe_width,
        shared_intermediate_size=n_shared * moe_width if router is not None else 0,
        num_nextn_predict_layers=mtp,
        **flags,
    )
