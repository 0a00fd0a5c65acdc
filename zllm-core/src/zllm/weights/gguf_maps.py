"""Declarative maps from a GGUF architecture to zllm's canonical (Hugging Face) view: the types.

A GGUF file names its ``general.architecture``; a :class:`GGUFArchMap` states, as data:

- how to build an HF-style ``config.json`` dict from the GGUF key/values, with the default
  llama.cpp uses when a key is absent;
- the GGUF tensor name → HF tensor name map;
- the RoPE row layout of the Q and K projections, which the config reports
  (``rope_interleaved``) so the model rotates the pairs where the file keeps them.

The maps themselves belong to the model families: a family distribution hands its maps to
the core as data (``FamilyInfo.gguf_architectures``), the plugin host collects them
(``PluginHost.gguf_maps``) and :func:`zllm.weights.open_checkpoint` reads a GGUF file
through them. A third-party family adds a GGUF architecture without a core release.

What is shared by every architecture lives here (llama.cpp, ggml-org/llama.cpp):

- ``{arch}.*`` keys are read by their ``gguf-py/gguf/constants.py`` names (``Keys.LLM``,
  ``Keys.Attention``, ``Keys.Rope``);
- RoPE scaling keys (``Keys.Rope``): ``{arch}.rope.scaling.type`` (``none``, ``linear``,
  ``yarn``; llama.cpp's ``LLAMA_ROPE_SCALING_TYPES``), ``.factor``,
  ``.original_context_length``, ``.yarn_beta_fast``/``.yarn_beta_slow``; llama3's
  per-frequency factors are the tensor ``rope_freqs.weight`` (``MODEL_TENSOR.ROPE_FREQS``)
  written by ``LlamaModel.generate_extra_tensors`` (see :func:`rope_scaling_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

# The map may need a value that llama.cpp requires: no default, absence is an error.
REQUIRED = object()

# RoPE row layouts of the Q/K projection weights (and biases) in a GGUF file.
# HF (half-rotation, "NeoX" style): within each head, rotation pair i is rows (i, i + D/2).
# GGUF for llama-type RoPE (Meta's original, adjacent pairs): pair i is rows (2i, 2i + 1).
# convert_hf_to_gguf.py LlamaModel.permute turns HF into GGUF:
#     w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
# The permutation stays inside each head and is the same for Q and K, so attention scores are
# unchanged when RoPE rotates the adjacent pairs instead (llama.cpp's LLAMA_ROPE_TYPE_NORM):
# the weights are handed out as stored (zero-copy) and the config says
# "rope_interleaved": true, which the model families read as the GPT-J RoPE layout.
ROPE_ADJACENT_PAIR = "adjacent_pair"
ROPE_HALF_ROTATION = "half_rotation"  # HF order: the config says nothing


@attrs.frozen
class ConfigKey:
    """One HF config entry read from the GGUF key ``{arch}.{gguf_key}``.

    ``default`` is a constant, :data:`REQUIRED`, or a function of the config entries built so
    far (entries are built in declaration order).
    """

    hf_key: str
    gguf_key: str
    default: Any = REQUIRED


@attrs.frozen
class GGUFArchMap:
    """Everything the weights layer needs to present one GGUF architecture in HF terms.

    Attributes:
        model_type: the HF ``config["model_type"]`` of this architecture.
        constants: config entries fixed by the architecture (not stored in GGUF).
        keys: config entries read from ``{arch}.*`` keys.
        global_tensors: GGUF tensor base name (no ``.weight``/``.bias``) → HF base name.
        block_tensors: GGUF per-block base name (after ``blk.N.``) → HF name after
            ``model.layers.N.``.
        bias_flags: HF config flag → GGUF per-block tensor whose ``.bias`` presence sets it.
        rope_layout: row layout of Q/K in the file (:data:`ROPE_ADJACENT_PAIR` or
            :data:`ROPE_HALF_ROTATION`).
        finish_config: for settings that are a function of several keys, of keys that are
            not numbers (flags), or of which tensors the file holds: called last as
            ``finish_config(config, value, tensor_names)`` with the config built so far,
            ``value(key)`` (the decoded metadata value of ``key``, None if absent) and the
            file's GGUF tensor names; returns the finished config. It may raise ``ValueError``
            (reported as a checkpoint error naming the file). None: the config is complete.

    A ``block_tensors`` key may name the kind too (``exp_probs_b.bias``): that GGUF tensor maps
    to the value as the whole HF name after ``model.layers.N.``
    (``mlp.gate.e_score_correction_bias``), for HF names that do not end in ``.weight`` or
    ``.bias`` or whose kind differs.
    """

    model_type: str
    constants: dict[str, Any]
    keys: tuple[ConfigKey, ...]
    global_tensors: dict[str, str]
    block_tensors: dict[str, str]
    bias_flags: dict[str, str]
    rope_layout: str
    finish_config: Callable[[dict[str, Any], Callable[[str], Any], frozenset[str]], dict[str, Any]] | None = None


#: GGUF tensor holding per-frequency RoPE divisors (llama3 scaling); read into the config
#: as ``rope_freq_factors`` rather than presented as a weight.
ROPE_FREQS_TENSOR = "rope_freqs.weight"

#: ``{arch}.rope.scaling.type`` values zllm maps (``none`` means no scaling).
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def rope_scaling_config(get: Any, arch: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` dict from the ``{arch}.rope.scaling.*`` keys (``get(key)`` -> value
    or None), or None when unscaled.

    Raises:
        ValueError: an unmapped scaling type or YaRN key (names it and what is supported).
    """
    kind = get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
            f"(supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    factor = get(f"{arch}.rope.scaling.factor")
    if factor is None:
        raise ValueError(f"RoPE scaling {kind!r} needs {arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    attn_factor = get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise ValueError(f"YaRN {arch}.rope.scaling.attn_factor = {attn_factor} is not supported "
                         "(supported: absent or 1)")
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    log_multiplier = get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_multiplier is not None and float(log_multiplier) != 0.0:
        # DeepSeek YaRN: convert_hf_to_gguf.py writes 0.1 * mscale_all_dim; llama.cpp
        # (llm_build_deepseek2) scales the scores by mscale(mscale_all_dim)^2 and leaves
        # cos/sin unscaled, which is HF's cos/sin factor mscale(mscale) / mscale(mscale_all_dim)
        # with mscale == mscale_all_dim.
        scaling["mscale_all_dim"] = scaling["mscale"] = float(log_multiplier) / 0.1
    original = get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for hf_key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        value = get(f"{arch}.rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = float(value)
    return scaling


def call_default(default: Any, config: dict[str, Any]) -> Any:
    """The default value of a :class:`ConfigKey` given the entries built so far."""
    return default(config) if callable(default) else default
