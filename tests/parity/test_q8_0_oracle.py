"""The Q8_0 file's oracle: the f32 reference on weights dequantized by the `gguf` package.

zllm keeps Q8_0 weights quantized and decodes them inside the CPU kernels; the oracle runs
every op through the core's f32 references on an f32 checkpoint whose weights were
dequantized with ``gguf.quants.dequantize``. Greedy tokens must agree over 64 tokens and
logits within 1e-3 (both sides compute in f32 from the same dequantized values; only
summation order differs).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import zllm
from tests.conftest import CONFIGS, MODEL_DIR, copy_tokenizer, write_config
from zllm.weights import open_checkpoint
from zllm.weights.formats import QuantizedTensor

ALL_OPS = ["embedding", "linear", "rms_norm", "rope", "attention", "silu_mul", "sample"]
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def _dequantized_checkpoint(gguf_path, out_dir):
    ckpt = open_checkpoint(gguf_path)
    tensors = {}
    for name in ckpt.tensor_names():
        t = ckpt.tensor(name)
        if isinstance(t, QuantizedTensor):
            t = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data.numpy(), GGUF_TYPES[t.fmt])))
        tensors[name] = t.float().contiguous()
    out_dir.mkdir()
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(ckpt.config))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    copy_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q8")
    ref_dir = _dequantized_checkpoint(MODEL_DIR / "gguf" / "stories260K-q8_0.gguf", tmp / "dequantized")
    oracle = zllm.Engine.from_config(write_config(tmp, ref_dir, backend={"force_reference": ALL_OPS}))
    quantized = zllm.Engine.from_config(CONFIGS / "stories260k-gguf-q8_0.yaml")
    return oracle, quantized


def test_q8_0_weights_stay_quantized_in_memory(engines):
    _, quantized = engines
    model = quantized.loaded.model
    assert isinstance(model.embed, QuantizedTensor) and model.embed.fmt == "q8_0"
    assert isinstance(model.layers[0].q, QuantizedTensor)


def test_q8_0_greedy_tokens_match_f32_reference_on_dequantized_weights(engines):
    oracle, quantized = engines
    request = {"prompt": "", "max_tokens": 64, "stop_token_ids": []}
    expected = oracle.generate(request)["token_ids"]
    assert quantized.generate(request)["token_ids"] == expected
    assert len(expected) == 64


def test_q8_0_logits_within_1e3_of_reference(engines):
    oracle, quantized = engines
    tokens = [1] + oracle.generate({"prompt": "", "max_tokens": 64, "stop_token_ids": []})["token_ids"]
    torch.testing.assert_close(quantized.prompt_logits(tokens), oracle.prompt_logits(tokens), atol=1e-3, rtol=0)


def test_forced_reference_is_reported_by_explain(engines):
    oracle, _ = engines
    reasons = {e.capability: e.reason for e in oracle.loaded.ops.explain()}
    assert all("forced" in r for r in reasons.values()), reasons
