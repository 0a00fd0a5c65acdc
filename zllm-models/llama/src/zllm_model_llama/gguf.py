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

Mixture-of-Experts files (``convert_hf_to_gguf.py`` ``LlamaModel`` / ``Qwen2MoeModel``;
``src/models/llama.cpp``, ``qwen2moe.cpp``, ``qwen3moe.cpp``):

- Mixtral is written as architecture ``llama``: a ``llama`` file with ``llama.expert_count``
  > 0 reads as ``mixtral`` (``num_local_experts``, ``num_experts_per_tok`` from
  ``expert_used_count``; each expert is ``feed_forward_length`` wide). ``qwen2moe`` and
  ``qwen3moe`` are their own architectures; their expert width is
  ``expert_feed_forward_length`` and Qwen2-MoE's shared expert
  ``expert_shared_feed_forward_length``.
- Experts are stacked ``ffn_{gate,up,down}_exps`` ``[E, N, K]`` (``[E, K, N]`` for down),
  the router is ``ffn_gate_inp`` ``[E, K]``; Qwen2-MoE's shared expert is
  ``ffn_{gate,up,down}_shexp`` gated by ``sigmoid(ffn_gate_inp_shexp · x)``.
- GGUF has no key for top-k renormalisation; llama.cpp's graphs fix it per architecture
  (``build_moe_ffn``'s ``norm_w``): ``llama`` (Mixtral) and ``qwen3moe`` renormalise,
  ``qwen2moe`` does not. A file that says ``expert_weights_norm`` is read as it says.
- Every layer is a MoE layer, as llama.cpp builds these architectures (its converter cannot
  write Qwen2-MoE's dense ``mlp_only_layers``); a layer without its ``ffn_gate_inp`` is a
  missing tensor, named.
"""

from __future__ import annotations

from collections.abc import Callable
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

# Expert settings; absent in a dense file (None), so a dense file reads as before.
_MOE_KEYS = (
    ConfigKey("gguf.expert_count", "expert_count", None),
    ConfigKey("num_experts_per_tok", "expert_used_count", None),
)
_QWEN_MOE_KEYS = (
    ConfigKey("num_experts", "expert_count"),
    ConfigKey("num_experts_per_tok", "expert_used_count"),
    ConfigKey("moe_intermediate_size", "expert_feed_forward_length"),
)

def _renormalised(arch: str, value: Callable[[str], Any], default: bool) -> bool:
    """Top-k renormalisation: ``{arch}.expert_weights_norm`` when the file has it, else
    llama.cpp's fixed choice for the architecture (see the module docstring)."""
    norm = value(f"{arch}.expert_weights_norm")
    return default if norm is None else bool(norm)


def _finish_llama(config: dict[str, Any], value: Callable[[str], Any], tensors: frozenset[str]) -> dict[str, Any]:
    """A ``llama`` file with experts is Mixtral (``MixtralForCausalLM`` converts as ``llama``)."""
    experts = config.pop("gguf.expert_count")
    if experts is None:
        config.pop("num_experts_per_tok")
        return config
    if config["num_experts_per_tok"] is None:
        raise ValueError("llama.expert_count is set but llama.expert_used_count is missing")
    if not _renormalised("llama", value, True):
        raise ValueError("llama.expert_weights_norm false: Mixtral always renormalises its top-k weights "
                         "(supported: absent or true)")
    for key in ("attention_bias", "mlp_bias"):
        if config.pop(key):
            raise ValueError(f"a Mixtral file (llama.expert_count {experts}) with {key.replace('_', ' ')}es; "
                             "Mixtral has none")
    return {**config, "model_type": "mixtral", "num_local_experts": experts, "sliding_window": None}


def _qwen_moe_finisher(arch: str, renormalise: bool) -> Callable[..., dict[str, Any]]:
    """``finish_config`` of ``qwen2moe`` / ``qwen3moe``: top-k renormalisation."""

    def finish(config: dict[str, Any], value: Callable[[str], Any], tensors: frozenset[str]) -> dict[str, Any]:
        config["norm_topk_prob"] = _renormalised(arch, value, renormalise)
        return config

    return finish


_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MOE_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
                "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
                "ffn_down_exps.weight": "mlp.experts.down_proj.weight"}

LLAMA = GGUFArchMap(
    model_type="llama",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS + _MOE_KEYS,
    global_tensors={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
    block_tensors={
        **_BLOCK_TENSORS,
        # Mixtral (see _finish_llama): its MoE block's HF names.
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps.weight": "block_sparse_moe.experts.w1.weight",
        "ffn_up_exps.weight": "block_sparse_moe.experts.w3.weight",
        "ffn_down_exps.weight": "block_sparse_moe.experts.w2.weight",
    },
    bias_flags={"attention_bias": "attn_q", "mlp_bias": "ffn_up"},
    rope_layout=ROPE_ADJACENT_PAIR,
    finish_config=_finish_llama,
)


QWEN2 = GGUFArchMap(
    model_type="qwen2",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS,
    global_tensors=LLAMA.global_tensors,
    block_tensors=_BLOCK_TENSORS,
    bias_flags={},  # q/k/v biases are part of the architecture (Qwen2Attention)
    rope_layout=ROPE_HALF_ROTATION,
)

QWEN3 = GGUFArchMap(
    model_type="qwen3",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS,
    global_tensors=LLAMA.global_tensors,
    block_tensors={**_BLOCK_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    bias_flags={"attention_bias": "attn_q"},
    rope_layout=ROPE_HALF_ROTATION,
)

QWEN2_MOE = GGUFArchMap(
    model_type="qwen2_moe",
    constants={"hidden_act": "silu"},
    keys=(*_DECODER_KEYS, *_QWEN_MOE_KEYS,
          ConfigKey("shared_expert_intermediate_size", "expert_shared_feed_forward_length")),
    global_tensors=LLAMA.global_tensors,
    block_tensors={**_BLOCK_TENSORS, **_MOE_TENSORS, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
    bias_flags={},  # q/k/v biases are part of the architecture, as Qwen2
    rope_layout=ROPE_HALF_ROTATION,
    finish_config=_qwen_moe_finisher("qwen2moe", renormalise=False),
)

QWEN3_MOE = GGUFArchMap(
    model_type="qwen3_moe",
    constants={"hidden_act": "silu"},
    keys=_DECODER_KEYS + _QWEN_MOE_KEYS,
    global_tensors=LLAMA.global_tensors,
    block_tensors={**QWEN3.block_tensors, **_MOE_TENSORS},
    bias_flags={"attention_bias": "attn_q"},
    rope_layout=ROPE_HALF_ROTATION,
    finish_config=_qwen_moe_finisher("qwen3moe", renormalise=True),
)

#: Architecture -> map, for ``FamilyInfo.gguf_architectures`` (each family publishes the
#: architectures whose ``model_type`` it handles).
GGUF_ARCHITECTURES: dict[str, GGUFArchMap] = {
    "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen2moe": QWEN2_MOE, "qwen3moe": QWEN3_MOE,
}
