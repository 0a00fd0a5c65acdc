"""The GGUF architectures of the llama-style families, as data handed to zllm-core.

For each GGUF ``general.architecture`` written by llama.cpp for these families (``llama``,
also what the converter writes for Mistral; ``qwen2``; ``qwen3``), a
:class:`~zllm.plugin_api.GGUFArchMap` says how the file reads in HF terms. The plugin
publishes them in ``FamilyInfo.gguf_architectures``.

Sources (llama.cpp, ggml-org/llama.cpp):

- defaults: ``src/llama-model.cpp`` ``llama_model::load_hparams`` — ``n_head_kv`` defaults to
  ``n_head``; ``n_embd_head_k`` defaults to ``n_embd / n_head``; ``rope_freq_base_train``
  defaults to 10000; context length, embedding length, feed-forward length, block count,
  head count and (for llama) the RMS-norm epsilon are required;
- tensor names: ``gguf-py/gguf/constants.py`` ``TENSOR_NAMES`` / ``MODEL_TENSORS[LLAMA]`` and
  ``gguf-py/gguf/tensor_mapping.py`` (HF names per GGUF tensor);
- ``output.weight`` absent means tied embeddings: ``llama-model.cpp`` creates ``output`` with
  ``TENSOR_NOT_REQUIRED`` and falls back to ``token_embd`` (``TENSOR_DUPLICATED``);
- Q/K row order: ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` (see
  :data:`~zllm.plugin_api.ROPE_ADJACENT_PAIR`);
- RoPE type per architecture: ``src/llama-model.cpp`` ``llama_model_rope_type``:
  ``LLM_ARCH_LLAMA`` -> ``LLAMA_ROPE_TYPE_NORM`` (adjacent pairs; the converter permutes Q/K
  rows), ``LLM_ARCH_QWEN2``/``LLM_ARCH_QWEN3`` -> ``LLAMA_ROPE_TYPE_NEOX`` (half rotation, HF
  row order, no permutation: ``Qwen2Model`` in ``convert_hf_to_gguf.py`` does not override
  ``modify_tensors``);
- Qwen3 per-head norms: ``blk.N.attn_q_norm`` / ``blk.N.attn_k_norm``
  (``MODEL_TENSORS[QWEN3]``); Qwen2 q/k/v biases are ``blk.N.attn_{q,k,v}.bias``.
"""

from __future__ import annotations

from typing import Any

from zllm.plugin_api import (
    ROPE_ADJACENT_PAIR,
    ROPE_HALF_ROTATION,
    ConfigKey,
    GGUFArchMap,
)


def _heads(config: dict[str, Any]) -> int:
    return config["num_attention_heads"]


def _head_dim(config: dict[str, Any]) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


# The transformer-decoder hyperparameters llama.cpp stores under the same names for every
# architecture mapped here (llama.cpp's LLM_KV_* keys, prefixed with the architecture).
_DECODER_KEYS = (
    ConfigKey("max_position_embeddings", "context_length"),
    ConfigKey("hidden_size", "embedding_length"),
    ConfigKey("intermediate_size", "feed_forward_length"),
    ConfigKey("num_hidden_layers", "block_count"),
    ConfigKey("num_attention_heads", "attention.head_count"),
    ConfigKey("num_key_value_heads", "attention.head_count_kv", _heads),
    ConfigKey("head_dim", "attention.key_length", _head_dim),
    ConfigKey("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ConfigKey("rope_theta", "rope.freq_base", 10000.0),
)

LLAMA = GGUFArchMap(
    model_type="llama",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS,
    global_tensors={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
    block_tensors={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    bias_flags={"attention_bias": "attn_q", "mlp_bias": "ffn_up"},
    rope_layout=ROPE_ADJACENT_PAIR,
)


QWEN2 = GGUFArchMap(
    model_type="qwen2",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS,
    global_tensors=LLAMA.global_tensors,
    block_tensors=LLAMA.block_tensors,
    bias_flags={},  # q/k/v biases are part of the architecture (Qwen2Attention)
    rope_layout=ROPE_HALF_ROTATION,
)

QWEN3 = GGUFArchMap(
    model_type="qwen3",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS,
    global_tensors=LLAMA.global_tensors,
    block_tensors={**LLAMA.block_tensors, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    bias_flags={"attention_bias": "attn_q"},
    rope_layout=ROPE_HALF_ROTATION,
)

#: Architecture -> map, for ``FamilyInfo.gguf_architectures`` (each family publishes the
#: architectures whose ``model_type`` it handles).
GGUF_ARCHITECTURES: dict[str, GGUFArchMap] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
