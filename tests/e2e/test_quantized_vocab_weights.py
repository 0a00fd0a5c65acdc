"""A quantized ``lm_head`` or ``model.embed_tokens`` (a quantizer whose ignore list leaves them in,
as ``write_fp8(modules=...)`` writes them) loads folded and runs as the dequantized f32 copy does.

The llama family gives both weights a vocabulary shard, whole on one rank; that shard was read
as a tensor-parallel split (refused for HF quantized formats), and the HF checkpoint sliced the
fold's first stored part (the raw F8 ``weight``), not the folded weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import zllm
from tests import quant_checkpoints as qc
from tests.conftest import copy_tokenizer, write_config

PROMPT = [1, 5, 9, 42]


def _llama(path: Path, tied: bool) -> Path:
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # random init is tiny: widen it so the tokens are not all alike
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path


@pytest.mark.parametrize(("tied", "vocab_module"), [(False, "lm_head"), (True, "embed_tokens")])
def test_fp8_vocab_weight_runs_as_its_dequantized_copy(tmp_path, tied, vocab_module):
    dense = _llama(tmp_path / "dense", tied)
    quantized, reference = tmp_path / "fp8", tmp_path / "reference"
    qc.write_dense(dense, reference, qc.write_fp8(dense, quantized, (32, 32), modules=(*qc.QUANTIZED, vocab_module)))
    request = {"prompt_token_ids": PROMPT, "max_tokens": 8, "stop_token_ids": []}
    outs = []
    for ckpt in (quantized, reference):
        with zllm.Engine.from_config(write_config(ckpt, ckpt)) as engine:
            outs.append((engine.prompt_logits(PROMPT), engine.generate(request)["token_ids"]))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=0)
    assert outs[0][1] == outs[1][1]
