"""The GGUF architecture ``deepseek2`` (DeepSeek-V2 and V3 files), as data handed to zllm-core.

Sources (ggml-org/llama.cpp): ``convert_hf_to_gguf.py`` ``DeepseekV2Model`` (what is written),
``src/llama-model.cpp`` ``load_hparams`` / ``build_deepseek2`` and ``src/llama-graph.cpp``
``build_moe_ffn`` (how it is read), ``gguf-py/gguf/constants.py`` ``MODEL_TENSORS[DEEPSEEK2]``.

What a ``deepseek2`` file says, and how it reads in HF terms:

- ``attention.head_count_kv`` is 1, ``attention.key_length`` is ``kv_lora_rank +
  qk_rope_head_dim`` and ``attention.value_length`` is ``kv_lora_rank`` (the absorbed MLA
  view); the per-head dims are ``attention.key_length_mla`` (``Dn + Dr``) and
  ``attention.value_length_mla`` (``Dv``). Older files have no ``*_mla`` keys and store the
  per-head dims in ``key_length`` / ``value_length``. ``rope.dimension_count`` is ``Dr``.
- ``kv_b_proj`` is either one ``attn_kv_b`` or, as the converter writes it now, split per
  head into ``attn_k_b`` ``[H, R, Dn]`` (transposed) and ``attn_v_b`` ``[H, Dv, R]``; the config
  says which (``kv_b_split``) and the model joins them back once at load.
- ``rope.scaling.yarn_log_multiplier`` is ``0.1 * mscale_all_dim`` (read by the core, with
  ``mscale == mscale_all_dim`` as llama.cpp assumes). RoPE rotates adjacent pairs
  (``LLAMA_ROPE_TYPE_NORM``), on the rows as stored.
- Routing: ``expert_gating_func`` 1 is softmax (DeepSeek-V2), 2 sigmoid (DeepSeek-V3); a
  missing key means softmax. ``expert_weights_norm`` is written only when true (absent:
  no renormalisation — so a V3 file without it routes without, whatever transformers'
  default). ``expert_weights_scale`` is ``routed_scaling_factor``; ``expert_group_count`` /
  ``expert_group_used_count`` are ``n_group`` / ``topk_group``. llama.cpp scores a group by
  the sum of its top-2 scores for either gating function; that is DeepSeek-V3's rule
  (``noaux_tc``), so sigmoid files read as ``deepseek_v3``. For a softmax file with groups
  llama.cpp's top-2 sum differs from DeepSeek-V2's max (``group_limited_greedy``), and a
  renormalised softmax router is no DeepSeek-V2 setting: both are refused, naming the key.
- ``exp_probs_b`` is ``e_score_correction_bias``; ``leading_dense_block_count`` is
  ``first_k_dense_replace``; experts are stacked ``ffn_{gate,up,down}_exps`` ``[E, N, K]``
  (``experts_stacked``), shared experts ``ffn_*_shexp``.
- The converter drops MTP layers (``nextn_predict_layers`` is read when present).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zllm.plugin_api import REQUIRED, ROPE_ADJACENT_PAIR, ConfigKey, GGUFArchMap

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*


def _heads(config: dict[str, Any]) -> int:
    return config["num_attention_heads"]


_KEYS = (
    ConfigKey("max_position_embeddings", "context_length"),
    ConfigKey("hidden_size", "embedding_length"),
    ConfigKey("intermediate_size", "feed_forward_length"),
    ConfigKey("num_hidden_layers", "block_count"),
    ConfigKey("num_attention_heads", "attention.head_count"),
    ConfigKey("gguf.head_count_kv", "attention.head_count_kv", _heads),
    ConfigKey("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ConfigKey("rope_theta", "rope.freq_base", 10000.0),
    ConfigKey("kv_lora_rank", "attention.kv_lora_rank", REQUIRED),
    ConfigKey("q_lora_rank", "attention.q_lora_rank", None),
    ConfigKey("qk_rope_head_dim", "rope.dimension_count", REQUIRED),
    ConfigKey("gguf.key_length", "attention.key_length", REQUIRED),
    ConfigKey("gguf.value_length", "attention.value_length", REQUIRED),
    ConfigKey("gguf.key_length_mla", "attention.key_length_mla", None),
    ConfigKey("gguf.value_length_mla", "attention.value_length_mla", None),
    ConfigKey("moe_intermediate_size", "expert_feed_forward_length", None),
    ConfigKey("n_routed_experts", "expert_count", None),
    ConfigKey("num_experts_per_tok", "expert_used_count", None),
    ConfigKey("routed_scaling_factor", "expert_weights_scale", 1.0),
    ConfigKey("n_group", "expert_group_count", 1),
    ConfigKey("topk_group", "expert_group_used_count", 1),
)


def _finish(
    config: dict[str, Any], value: Callable[[str], Any], tensors: frozenset[str]
) -> dict[str, Any]:
    """The HF view of the settings that are no one-to-one key (see the module docstring)."""
    cfg = {k: v for k, v in config.items() if not k.startswith("gguf.")}
    rope_dim = cfg["qk_rope_head_dim"]
    mla_keys = config["gguf.key_length_mla"] is not None
    key_length = config["gguf.key_length_mla"] if mla_keys else config["gguf.key_length"]
    if key_length <= rope_dim:
        key = "key_length_mla" if mla_keys else "key_length"
        raise ValueError(
            f"deepseek2.attention.{key} {key_length} leaves no nope dims beside "
            "rope.dimension_count "
            f"{rope_dim}"
        )
    cfg["qk_nope_head_dim"] = key_length - rope_dim
    cfg["v_head_dim"] = config["gguf.value_length_mla"] if mla_keys else config["gguf.value_length"]
    # Counts that may be 0, which the core's number keys refuse.
    for hf_key, gguf_key in (
        ("first_k_dense_replace", "leading_dense_block_count"),
        ("n_shared_experts", "expert_shared_count"),
        ("num_nextn_predict_layers", "nextn_predict_layers"),
    ):
        count = value(f"deepseek2.{gguf_key}")
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 0
        ):
            raise ValueError(f"deepseek2.{gguf_key} {count!r} is not an integer >= 0")
        cfg[hf_key] = count or 0
    gating = value("deepseek2.expert_gating_func")
    gating = 1 if gating is None else gating
    if gating not in GATING_FUNCS:
        raise ValueError(
            f"deepseek2.expert_gating_func {gating!r} is not supported "
            f"(supported: {', '.join(f'{k} {v}' for k, v in GATING_FUNCS.items())})"
        )
    norm = bool(value("deepseek2.expert_weights_norm") or False)
    grouped = (cfg["n_group"] or 1) > 1
    if GATING_FUNCS[gating] == "sigmoid":
        cfg |= {
            "model_type": "deepseek_v3",
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "norm_topk_prob": norm,
        }
    else:
        if cfg["n_routed_experts"] is not None and grouped:
            raise ValueError(
                "deepseek2.expert_group_count > 1 with softmax gating: llama.cpp scores a group "
                "by the sum of its top-2, DeepSeek-V2 by its max; not supported "
                "(supported: 1 group)"
            )
        if norm:
            raise ValueError(
                "deepseek2.expert_weights_norm true with softmax gating is no DeepSeek-V2 routing "
                "(supported: absent)"
            )
        cfg |= {"model_type": "deepseek_v2", "topk_method": "greedy"}
    cfg["rope_interleave"] = True  # adjacent pairs, as stored (LLAMA_ROPE_TYPE_NORM)
    cfg["kv_b_split"] = "blk.0.attn_k_b.weight" in tensors
    cfg["experts_stacked"] = True
    cfg.pop("rope_interleaved", None)
    return cfg


DEEPSEEK2 = GGUFArchMap(
    model_type="deepseek_v2",
    constants={"hidden_act": "silu"},
    keys=_KEYS,
    global_tensors={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
    block_tensors={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_exps.weight": "mlp.experts.gate_proj",
        "ffn_up_exps.weight": "mlp.experts.up_proj",
        "ffn_down_exps.weight": "mlp.experts.down_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    bias_flags={"attention_bias": "attn_kv_a_mqa"},
    rope_layout=ROPE_ADJACENT_PAIR,
    finish_config=_finish,
)

#: Architecture -> map, for ``FamilyInfo.gguf_architectures``.
GGUF_ARCHITECTURES: dict[str, GGUFArchMap] = {"deepseek2": DEEPSEEK2}
