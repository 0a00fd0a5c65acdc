"""The frozen llama model spec, read from an HF-style config dict."""

from __future__ import annotations

from typing import Any

import attrs

from zllm.plugin_api import CheckpointError


@attrs.frozen
class LlamaSpec:
    """Dimensions and constants of one llama model. Units: counts of elements/tokens."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    """RoPE base from either config style: ``rope_theta`` + ``rope_scaling`` (transformers
    < 5) or the ``rope_parameters`` block (transformers >= 5)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(source, f"RoPE scaling type {rope_type!r} is not supported by this llama family version (supported: default)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def spec_from_config(cfg: dict[str, Any], source: str) -> LlamaSpec:
    """Build a :class:`LlamaSpec` from an HF ``LlamaConfig``-style dict.

    Raises:
        CheckpointError: a required key is missing, a value is inconsistent (heads not
            dividing), or a feature this family does not implement is configured.
    """
    def need(key: str) -> Any:
        if key not in cfg:
            raise CheckpointError(source, f"llama config lacks required key {key!r}")
        return cfg[key]

    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(source, f"hidden_act {cfg['hidden_act']!r} is not supported (supported: silu)")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(source, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return LlamaSpec(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, source),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
