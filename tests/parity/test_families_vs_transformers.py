"""mistral, qwen2, qwen3 and llama's RoPE scalings match HF transformers on tiny random
checkpoints that transformers saves; qwen2/qwen3/llama GGUF files written from them with the
`gguf` package's writer give the same logits as the HF directory.

Tolerances: f32 -> logits within 1e-4 (abs) of HF over the prompt, and 32 greedy tokens
identical to ``generate(do_sample=False)``.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import transformers

import zllm
from tests.conftest import MODEL_DIR, write_config
from tests.parity.hf_models import PROMPT, hf_greedy, hf_logits, save_widened
from zllm.spec.errors import ZllmError

VOCAB = 512  # the stories260K tokenizer
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}

# case -> (model_type, config overrides)
CASES = {
    "llama-llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3)),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "llama-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "mistral-sliding": ("mistral", dict(sliding_window=6, tie_word_embeddings=False)),
    "mistral-tied-full": ("mistral", dict(sliding_window=None, tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-mixed-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                         layer_types=["sliding_attention", "full_attention"])),
    "qwen2-max-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
    "qwen3-headdim": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-bias-tied-yarn": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 64})),
    "qwen3-all-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=7, head_dim=16,
                                        layer_types=["sliding_attention", "sliding_attention"])),
}
CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
MODELS = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
          "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}


def _save(tmp_path, case: str):
    model_type, overrides = CASES[case]
    config = CONFIGS[model_type](**{**BASE, **overrides})
    path = tmp_path / case
    return save_widened(path, MODELS[model_type], config, sum(map(ord, case))), path


def _check_generation(engine, hf_tokens):
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 32, "stop_token_ids": []})
    n = len(out["token_ids"])
    assert out["token_ids"] == hf_tokens[:n]
    assert n == 32 or out["finish_reason"] == "stop"


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    model, path = _save(tmp_path, case)
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.family_info.name == CASES[case][0]
    torch.testing.assert_close(engine.prompt_logits(PROMPT), hf_logits(model, PROMPT), atol=1e-4, rtol=0)
    _check_generation(engine, hf_greedy(model))


def test_all_sliding_model_frees_blocks_outside_the_window_and_still_matches(tmp_path):
    """Window 6, blocks of 4: 47 tokens would need 12 blocks; 5 suffice because blocks wholly
    before the window go back to the free list (chunked prefill of 4 tokens included)."""
    model, path = _save(tmp_path, "mistral-sliding")
    cfg = write_config(tmp_path, path,
                       runtime={"kv_cache": {"block_size": 4, "num_blocks": 5}, "max_prefill_tokens": 4})
    engine = zllm.Engine.from_config(cfg)
    kv = engine.llm.scheduler.kv
    assert kv.sliding_window == 6
    hf_tokens = hf_greedy(model)
    request = engine.parse({"prompt_token_ids": PROMPT, "max_tokens": 32, "stop_token_ids": []})
    seq = engine.llm.add_request(request, PROMPT, 32)
    seen_evicted = 0
    while engine.llm.has_work():
        engine.llm.step()
        if seq.kv.num_tokens:
            held = [b for b in seq.kv.blocks if b >= 0]
            assert len(held) <= 3, seq.kv.blocks  # ceil(6 / 4) + 1
            assert seq.kv.blocks[: seq.kv.num_evicted] == [-1] * seq.kv.num_evicted
            seen_evicted = max(seen_evicted, seq.kv.num_evicted)
    assert seq.output_ids == hf_tokens
    assert seen_evicted >= 8
    # A sequence that lost blocks is freed, not parked for prefix reuse.
    assert kv.num_free_blocks == 5


def test_mixed_full_and_sliding_model_keeps_every_block(tmp_path):
    _, path = _save(tmp_path, "qwen2-mixed-layers")
    engine = zllm.Engine.from_config(write_config(tmp_path, path, runtime={"kv_cache": {"block_size": 4}}))
    assert engine.llm.scheduler.kv.sliding_window is None
    assert str(engine.loaded.ops.explain()[0].capability)  # both attention ops are bound
    assert {"attention[paged]", "attention_sliding[paged]"} <= {e.capability for e in engine.loaded.ops.explain()}


@pytest.mark.parametrize("config, message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     r"RoPE type 'longrope' is not supported \(supported rope_type: default, linear, dynamic, llama3, yarn\)"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5 is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(supported: silu\)"),
])
def test_unsupported_feature_is_one_line_naming_it_and_the_supported_ones(tmp_path, config, message):
    import json

    _, path = _save(tmp_path, "qwen2-bias-tied")
    data = json.loads((path / "config.json").read_text())
    data.update(config)
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ZllmError, match=message) as e:
        zllm.Engine.from_config(write_config(tmp_path, path))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- GGUF


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py`` ``LlamaModel.permute``: HF half-rotation rows -> adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:
    """``convert_hf_to_gguf.py`` ``LlamaModel.generate_extra_tensors`` for ``rope_type: llama3``."""
    p = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1)
        elif wavelen > low_wl:
            out.append(p["factor"])
        else:
            smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
                      / (p["high_freq_factor"] - p["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _write_gguf(model, dst, arch: str, extra_kv=None, extra_tensors=None):
    """An f32 GGUF of an HF model as llama.cpp's converter lays it out: the metadata keys
    ``Keys.LLM``/``Keys.Attention``/``Keys.Rope`` name, Q/K rows permuted for llama
    (``LLAMA_ROPE_TYPE_NORM``) and left in HF order for qwen2/qwen3 (``NEOX``), the
    stories260K vocabulary copied from the shipped GGUF."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(dst, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    vocab = gguf.GGUFReader(next((MODEL_DIR / "gguf").glob("*f32.gguf")))
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype,
                            sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for hf, gg in names.items():
        w.add_tensor(gg, sd[hf])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _BLOCK.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{hf}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                    t = _permute(t, cfg.num_attention_heads if hf == "self_attn.q_proj" else cfg.num_key_value_heads)
                w.add_tensor(f"blk.{i}.{gg}.{kind}", np.ascontiguousarray(t))
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


STR, F32, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("case", ["qwen2-bias-tied", "qwen3-headdim", "qwen3-bias-tied-yarn", "llama-llama3",
                                  "llama-linear"])
def test_gguf_written_from_hf_checkpoint_matches_hf_directory(tmp_path, case):
    model, path = _save(tmp_path, case)
    arch, cfg = CASES[case][0], model.config
    extra_kv, extra_tensors = {}, {}
    rope = cfg.rope_parameters
    if rope["rope_type"] == "llama3":
        extra_tensors["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    elif rope["rope_type"] == "linear":
        extra_kv = {f"{arch}.rope.scaling.type": ("linear", STR), f"{arch}.rope.scaling.factor": (rope["factor"], F32)}
    elif rope["rope_type"] == "yarn":
        extra_kv = {f"{arch}.rope.scaling.type": ("yarn", STR), f"{arch}.rope.scaling.factor": (rope["factor"], F32),
                    f"{arch}.rope.scaling.original_context_length": (rope["original_max_position_embeddings"], U32)}
    gguf_path = _write_gguf(model, tmp_path / f"{case}.gguf", arch, extra_kv, extra_tensors)
    (tmp_path / "g").mkdir()
    engine = zllm.Engine.from_config(write_config(tmp_path / "g", gguf_path))
    assert engine.loaded.family_info.name == arch
    hf_dir = zllm.Engine.from_config(write_config(tmp_path, path))
    ours = engine.prompt_logits(PROMPT)
    torch.testing.assert_close(ours, hf_dir.prompt_logits(PROMPT), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, hf_logits(model, PROMPT), atol=1e-4, rtol=0)
    _check_generation(engine, hf_greedy(model))
