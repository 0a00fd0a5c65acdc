"""The GGUF architecture ``gpt-oss`` as data handed to zllm-core.

Sources (llama.cpp, the sources vendored in ``llama-cpp-python`` 0.3.36):

- ``conversion/gpt_oss.py`` (``GptOssModel``): writes ``sliding_window`` and
  ``expert_feed_forward_length``; splits transformers' fused ``gate_up_proj [E, C, 2N]`` into
  ``ffn_gate_exps`` (even columns) and ``ffn_up_exps`` (odd columns), transposed to
  ``[E, N, C]``, ``down_proj`` to ``ffn_down_exps [E, C, N]``, each with its ``.bias``; the
  router is ``ffn_gate_inp`` (weight and bias), the sinks ``attn_sinks.weight``,
  ``post_attention_layernorm`` is ``post_attention_norm``; MXFP4 checkpoints keep their
  experts in ggml's MXFP4 blocks (the core's GGUF reader repacks them into ``mxfp4``).
- ``src/models/openai-moe.cpp`` (``LLM_ARCH_OPENAI_MOE``): sliding-window pattern 2 (even
  layers sliding, odd layers full: transformers' default ``layer_types``), RoPE type NEOX
  (half rotation, HF row order; no Q/K permutation), q/k/v/o biases always present.
- ``src/llama-graph.cpp`` (``LLM_FFN_SWIGLU_OAI_MOE``): the clamped SwiGLU with alpha 1.702 and limit 7.0
  as constants (the file stores neither), as every released gpt-oss config has them.
- YaRN: the file stores factor, original context and betas (``rope.scaling.*``); gpt-oss's
  YaRN does not truncate the correction range (``truncate: false`` in every released
  ``config.json``), which the file cannot say, so it is a constant of the architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zllm.plugin_api import ROPE_HALF_ROTATION, ConfigKey, GGUFArchMap

_ARCH = "gpt-oss"


def _heads(config: dict[str, Any]) -> int:
    return config["num_attention_heads"]


def _finish(config: dict[str, Any], value: Callable[[str], Any], tensors: frozenset[str]) -> dict[str, Any]:
    """Alternating window layers (llama.cpp's pattern 2); YaRN (the core read ``rope_scaling``)
    without truncation; a file without RoPE scaling says so explicitly, since a gpt-oss config
    without RoPE parameters means YaRN (``GptOssConfig``'s default)."""
    n = config["num_hidden_layers"]
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    scaling = config.pop("rope_scaling", None)
    rope: dict[str, Any] = {"rope_type": "default"} if scaling is None else {**scaling, "truncate": False}
    config["rope_parameters"] = {**rope, "rope_theta": config.pop("rope_theta")}
    return config


GPT_OSS = GGUFArchMap(
    model_type="gpt_oss",
    constants={"attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    keys=(
        ConfigKey("max_position_embeddings", "context_length"),
        ConfigKey("hidden_size", "embedding_length"),
        ConfigKey("intermediate_size", "expert_feed_forward_length"),
        ConfigKey("num_hidden_layers", "block_count"),
        ConfigKey("num_attention_heads", "attention.head_count"),
        ConfigKey("num_key_value_heads", "attention.head_count_kv", _heads),
        ConfigKey("head_dim", "attention.key_length"),
        ConfigKey("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
        ConfigKey("rope_theta", "rope.freq_base", 150000.0),
        ConfigKey("sliding_window", "attention.sliding_window"),
        ConfigKey("num_local_experts", "expert_count"),
        ConfigKey("num_experts_per_tok", "expert_used_count"),
    ),
    global_tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    block_tensors={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_sinks.weight": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    bias_flags={},
    rope_layout=ROPE_HALF_ROTATION,
    finish_config=_finish,
)

#: Architecture -> map, for ``FamilyInfo.gguf_architectures``.
GGUF_ARCHITECTURES: dict[str, GGUFArchMap] = {_ARCH: GPT_OSS}
