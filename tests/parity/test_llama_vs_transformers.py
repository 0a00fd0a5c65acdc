"""Llama math matches HF transformers on tiny random checkpoints that transformers saves.

Tolerances: f32 weights -> logits within 1e-4 (abs) of HF in f32, greedy tokens identical.
bf16/f16 weights (zllm computes in f32 on 16-bit stored weights) -> within 1e-4 of HF run
in f32 on the same rounded weights, and within 10% of the largest logit of HF's native
16-bit forward (which rounds every activation as well, ~2^-8 relative per op for bf16).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import zllm
from tests.conftest import copy_tokenizer, write_config

VOCAB = 512  # the stories260K tokenizer
PROMPT = [1, 410, 469, 347, 30, 99, 280, 17, 401, 5, 77, 300, 12, 64, 201]

CASES = {
    "gqa-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "mqa-untied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    "gqa-headdim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}


def _save(tmp_path, case: str, dtype=torch.float32):
    torch.manual_seed(hash(case) % 1000)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **CASES[case],
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Random init has tiny weights; widen them so the test sees real attention patterns.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model = model.to(dtype)
    path = tmp_path / case
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model, path


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    model, path = _save(tmp_path, case)
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    ours = engine.prompt_logits(PROMPT)
    torch.testing.assert_close(ours, _hf_logits(model, PROMPT), atol=1e-4, rtol=0)
    hf_tokens = model.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": 32, "stop_token_ids": []})
    n = len(out["token_ids"])
    assert out["token_ids"] == hf_tokens[:n]
    assert n == 32 or out["finish_reason"] == "stop"


def _reload(path, dtype):
    # A fresh load recomputes RoPE's inv_freq in f32; casting a live model with .to()
    # would round that buffer too and blur the comparison.
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16bit_weights_match_transformers_on_rounded_weights(tmp_path, dtype):
    _, path = _save(tmp_path, "gqa-tied", dtype=dtype)
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.model.embed.dtype == dtype  # weights stay 16-bit in memory
    ours = engine.prompt_logits(PROMPT)
    torch.testing.assert_close(ours, _hf_logits(_reload(path, torch.float32), PROMPT), atol=1e-4, rtol=0)
    native = _hf_logits(_reload(path, dtype), PROMPT)
    assert (ours - native).abs().max() <= 0.1 * native.abs().max()


def test_dtype_f32_config_upcasts_bf16_checkpoint(tmp_path):
    _, path = _save(tmp_path, "mha-untied", dtype=torch.bfloat16)
    engine = zllm.Engine.from_config(write_config(tmp_path, path, model={"dtype": "f32"}))
    assert engine.loaded.model.embed.dtype == torch.float32
    expected = _hf_logits(_reload(path, torch.float32), PROMPT)
    torch.testing.assert_close(engine.prompt_logits(PROMPT), expected, atol=1e-4, rtol=0)
