"""GGUF k-quant files (Q2_K … Q6_K) against their oracle: the f32 reference on weights decoded
by the `gguf` package.

The `gguf` package dequantizes k-quants but cannot quantize them, so each file is written here
with ``gguf.GGUFWriter`` as a small random llama (hidden 256 so every row holds whole 256-weight
super-blocks; 2 layers, 4 heads, 2 KV heads, FFN 512, the stories260K vocabulary of 512
copied from the shipped F32 file so the tokenizer loads). Every linear weight, the token
embedding and the (untied) output head are random but valid blocks of one k-quant type:
random bytes for quants and sub-block scales, f16 ``d``/``dmin`` set so weights have
~1/sqrt(K) spread and ~0 mean; norms are F32.

A fourth file is mixed as llama.cpp's Q4_K_M/Q5_K_M files are wherever a row is not whole
super-blocks (MoE experts of width 1408): FFN 352, so ``ffn_down``'s 352-weight rows are Q5_0
(encoded by gguf-py's quantizer, llama.cpp's reference) and every other weight Q4_K.

zllm keeps those weights quantized and decodes them inside the CPU kernels; the oracle runs
every op through the core's f32 references (``backend.force_reference``) on an f32
safetensors checkpoint of the same tensors read through the same loader (so llama's Q/K row
order is undone identically) and decoded with ``gguf.quants.dequantize``. Both compute in f32
from the same decoded values: prefill differs only in summation order, decode steps by the
native GEMV's int16 activations (~1e-5 relative, ``csrc/kquant_gemv.c``) where the native
library loads, so 32 greedy tokens must be identical and prompt logits agree within 1e-3.
The output head's scale (logit std ~8) keeps every greedy step's top-2 gap far above that
tolerance; the test asserts the gaps, so a near-tie cannot make the token comparison vacuous or
flaky.
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
from zllm.plugins.host import PluginHost
from zllm.spec.errors import TensorError
from zllm.weights import open_checkpoint
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor

ALL_OPS = ["embedding", "linear", "rms_norm", "add_rms_norm", "rope", "attention", "silu_mul"]
KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# Q4_K with Q5_0 where a row is not whole super-blocks: FFN 352 makes ffn_down's rows 352 weights
MIXED = "q4_k+q5_0"
MIXED_FFN, MIXED_FALLBACK = 352, "q5_0"
F32_FILE = MODEL_DIR / "gguf" / "stories260K-f32.gguf"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 512, 512
HEAD_DIM = HIDDEN // HEADS
N_TOKENS = 32
GREEDY = {"prompt": "", "max_tokens": N_TOKENS, "stop_token_ids": [], "ignore_eos": True}
# byte offsets of the f16 d (and dmin) in each block (ggml-common.h)
F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# dmin / d making the mean weight ~0: E[sc * q] / E[m] over uniform random bits
DMIN_RATIO = {"q2_k": 1.5, "q4_k": 7.5, "q5_k": 15.5}


def gguf_type(fmt: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[fmt.upper()]


def random_kquant(fmt: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, cols // 256 * type_size]``: random valid blocks whose weights have about ``std`` spread."""
    layout = BLOCK_LAYOUTS[fmt]
    raw = rng.integers(0, 256, (rows, cols // layout.block_size, layout.type_size), dtype=np.uint8)

    def set_scales(d: np.ndarray) -> None:
        raw[..., F16_FIELDS[fmt][0] : F16_FIELDS[fmt][0] + 2] = d.astype("<f2")[..., None].view(np.uint8)
        if fmt in DMIN_RATIO:
            dmin = (d * DMIN_RATIO[fmt]).astype("<f2")
            raw[..., F16_FIELDS[fmt][1] : F16_FIELDS[fmt][1] + 2] = dmin[..., None].view(np.uint8)

    jitter = rng.uniform(0.75, 1.25, raw.shape[:2])  # each super-block its own d
    set_scales(jitter)
    unit_std = float(gguf.quants.dequantize(raw.reshape(rows, -1), gguf_type(fmt)).std())
    set_scales(jitter * std / unit_std)
    return raw.reshape(rows, -1)


def write_random_llama(path, fmt: str, seed: int, ffn: int = FFN, fallback: str | None = None):
    """A llama GGUF whose weights are random ``fmt`` blocks (norms F32), with stories260K's vocabulary;
    weights whose rows are not whole ``fmt`` blocks are ``fallback``, from gguf-py's quantizer."""
    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(F32_FILE)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-llama-{fmt}")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)

    def quant(name: str, rows: int, cols: int, std: float) -> None:
        if cols % BLOCK_LAYOUTS[fmt].block_size == 0:
            writer.add_tensor(name, random_kquant(fmt, rows, cols, std, rng), raw_dtype=gguf_type(fmt))
        else:
            assert fallback is not None, (name, cols)
            w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(w, gguf_type(fallback)), raw_dtype=gguf_type(fallback))

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))

    quant("token_embd.weight", VOCAB, HIDDEN, 1.0)
    norm("output_norm.weight")
    quant("output.weight", VOCAB, HIDDEN, 8.0 / HIDDEN**0.5)  # logits std ~8: well-separated argmax
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        quant(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, 2.0 / HIDDEN**0.5)  # peaky enough attention
        quant(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, 2.0 / HIDDEN**0.5)
        quant(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, 1.0 / HIDDEN**0.5)
        quant(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, 1.0 / HIDDEN**0.5)
        quant(f"blk.{i}.ffn_gate.weight", ffn, HIDDEN, 1.0 / HIDDEN**0.5)
        quant(f"blk.{i}.ffn_up.weight", ffn, HIDDEN, 1.0 / HIDDEN**0.5)
        quant(f"blk.{i}.ffn_down.weight", HIDDEN, ffn, 1.0 / ffn**0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _dequantized_checkpoint(gguf_path, out_dir):
    ckpt = open_checkpoint(gguf_path, gguf_maps=PluginHost(allowlist=["llama"]).gguf_maps)
    tensors = {}
    for name in ckpt.tensor_names():
        t = ckpt.tensor(name)  # Q/K rows already in HF order: the same loader as the quantized run
        if isinstance(t, QuantizedTensor):
            t = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data.numpy(), gguf_type(t.fmt))))
        tensors[name] = t.float().contiguous()
    out_dir.mkdir()
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(ckpt.config))
    copy_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=[*KQUANTS, MIXED])
def engines(request, tmp_path_factory):
    fmt = request.param
    tmp = tmp_path_factory.mktemp(fmt)
    if fmt == MIXED:
        path = write_random_llama(tmp / "random-llama-mixed.gguf", "q4_k", seed=len(KQUANTS), ffn=MIXED_FFN,
                                  fallback=MIXED_FALLBACK)
    else:
        path = write_random_llama(tmp / f"random-llama-{fmt}.gguf", fmt, seed=KQUANTS.index(fmt))
    oracle_dir = _dequantized_checkpoint(path, tmp / "decoded")
    oracle = zllm.Engine.from_config(write_config(tmp, oracle_dir, backend={"force_reference": ALL_OPS}))
    (tmp / "q").mkdir()
    quantized = zllm.Engine.from_config(write_config(tmp / "q", path))
    expected = oracle.generate(GREEDY)["token_ids"]  # the oracle's greedy tokens, shared by the tests
    return fmt, oracle, quantized, expected


def test_weights_stay_in_their_stored_format(engines):
    fmt, _, quantized, _ = engines
    model = quantized.loaded.model
    main, down = ("q4_k", MIXED_FALLBACK) if fmt == MIXED else (fmt, fmt)
    attn = model.layers[0].qkv if model.layers[0].qkv is not None else model.layers[0].q  # joined when one format
    for weight in (model.embed, attn, model.layers[0].gate):
        assert isinstance(weight, QuantizedTensor) and weight.fmt == main
    assert isinstance(model.layers[1].down, QuantizedTensor) and model.layers[1].down.fmt == down


def test_greedy_tokens_match_f32_reference_on_decoded_weights(engines):
    _, oracle, quantized, expected = engines
    assert len(expected) == N_TOKENS and len(set(expected)) > 3  # not a degenerate repetition
    logits = oracle.prompt_logits([1] + expected)[:-1]  # [N_TOKENS, V]: the step that chose each token
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-2  # every argmax is >10x the logits tolerance clear
    assert quantized.generate(GREEDY)["token_ids"] == expected


def test_prompt_logits_within_1e3_of_reference(engines):
    _, oracle, quantized, expected = engines
    tokens = [1] + expected
    torch.testing.assert_close(quantized.prompt_logits(tokens), oracle.prompt_logits(tokens), atol=1e-3, rtol=0)


def test_row_that_is_not_whole_super_blocks_is_refused_naming_tensor_and_type(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
    # 2 rows of 128 weights stored as Q4_K: half a 256-weight super-block per row (72 bytes each)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros(2 * 72, dtype=np.uint8).view(np.float32), raw_shape=(2, 128),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_K)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TensorError) as err:
        open_checkpoint(tmp_path / "bad.gguf", gguf_maps=PluginHost(allowlist=["llama"]).gguf_maps)
    assert err.value.tensor == "blk.0.attn_q.weight"
    assert "Q4_K" in str(err.value) and "128" in str(err.value) and "256" in str(err.value)
