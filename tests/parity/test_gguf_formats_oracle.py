"""Quantized and 16-bit GGUF files against their oracle: the f32 reference on weights
decoded by the `gguf` package.

zllm keeps Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights quantized and BF16 weights in bf16, decoding
inside the CPU kernels; the oracle runs every op through the core's f32 references on an f32
checkpoint whose weights were decoded with ``gguf.quants.dequantize``. Greedy tokens must
agree over 64 tokens and prompt logits within 1e-3 (both sides compute in f32 from the same decoded
values; only summation order differs). The Q8_0 file ships with the model; the Q4_0, Q4_1,
Q5_0, Q5_1 and BF16 files are written from the F32 file by the `gguf` package's quantizer
(llama.cpp's reference quantizer) and writer. As in llama.cpp's quantizer, weights whose rows
are not whole 32-weight blocks (stories260K's ``ffn_down``, 172 in-features) stay F32.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import zllm
from tests.conftest import MODEL_DIR, copy_tokenizer, write_config
from tests.gguf_files import requantize
from zllm.plugins.host import PluginHost
from zllm.weights import open_checkpoint
from zllm.weights.formats import QuantizedTensor

ALL_OPS = ["embedding", "linear", "rms_norm", "add_rms_norm", "rope", "attention", "silu_mul"]
QUANTIZED = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
GGUF_TYPES = {fmt: gguf.GGMLQuantizationType[fmt.upper()] for fmt in QUANTIZED}
F32_FILE = MODEL_DIR / "gguf" / "stories260K-f32.gguf"
GREEDY = {"prompt": "", "max_tokens": 64, "stop_token_ids": []}


def _dequantized_checkpoint(gguf_path, out_dir):
    ckpt = open_checkpoint(gguf_path, gguf_maps=PluginHost(allowlist=["llama"]).gguf_maps)
    tensors = {}
    for name in ckpt.tensor_names():
        t = ckpt.tensor(name)
        if isinstance(t, QuantizedTensor):
            t = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data.numpy(), GGUF_TYPES[t.fmt])))
        tensors[name] = t.float().contiguous()
    out_dir.mkdir()
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(ckpt.config))
    copy_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=[*QUANTIZED, "bf16"])
def engines(request, tmp_path_factory):
    fmt = request.param
    tmp = tmp_path_factory.mktemp(fmt)
    if fmt == "q8_0":
        path = MODEL_DIR / "gguf" / "stories260K-q8_0.gguf"
    else:
        path = requantize(F32_FILE, tmp / f"stories260K-{fmt}.gguf", gguf.GGMLQuantizationType[fmt.upper()])
    oracle_dir = _dequantized_checkpoint(path, tmp / "decoded")
    oracle = zllm.Engine.from_config(write_config(tmp, oracle_dir, backend={"force_reference": ALL_OPS}))
    (tmp / "q").mkdir()
    quantized = zllm.Engine.from_config(write_config(tmp / "q", path))
    return fmt, oracle, quantized


def test_weights_stay_in_their_stored_format(engines):
    fmt, _, quantized = engines
    model = quantized.loaded.model
    # q, k and v share a format in these files: joined into one weight at load, still in it
    for weight in (model.embed, model.layers[0].qkv, model.layers[0].gate):
        if fmt == "bf16":
            assert weight.dtype == torch.bfloat16
        else:
            assert isinstance(weight, QuantizedTensor) and weight.fmt == fmt


def test_greedy_tokens_match_f32_reference_on_decoded_weights(engines):
    _, oracle, quantized = engines
    expected = oracle.generate(GREEDY)["token_ids"]
    assert len(expected) == 64
    assert quantized.generate(GREEDY)["token_ids"] == expected


def test_prompt_logits_within_1e3_of_reference(engines):
    _, oracle, quantized = engines
    tokens = [1] + oracle.generate(GREEDY)["token_ids"]
    torch.testing.assert_close(quantized.prompt_logits(tokens), oracle.prompt_logits(tokens), atol=1e-3, rtol=0)


def test_forced_reference_is_reported_by_explain(engines):
    _, oracle, _ = engines
    reasons = {e.capability: e.reason for e in oracle.loaded.ops.explain()}
    assert reasons and all("forced" in r for r in reasons.values()), reasons
