"""The f32 reference decodes of the HF checkpoints' formats (``zllm.domain.quant_hf``), read
through zllm's checkpoint folding, equal the decodes of the libraries that define them, bit
for bit: transformers' FP8 block dequantizer and MXFP4 ``convert_moe_packed_tensors``,
compressed-tensors' compressors (pinned in requirements-test.txt), and the ``gguf`` package's
MXFP4/NVFP4 block types for the E2M1 / E8M0 / E4M3 value tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests import quant_checkpoints as qc
from zllm.domain.quant import dequantize
from zllm.weights import open_checkpoint
from zllm.weights.formats import QuantizedTensor


def _write(path: Path, tensors: dict[str, torch.Tensor], qconfig: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qconfig}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _finite_e4m3(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random E4M3FN bytes without the NaN codes 0x7f / 0xff."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b)


def test_fp8_block_decode_equals_transformers_dequantizer(tmp_path):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    q = _finite_e4m3(g, 256, 384)
    scale = torch.rand(2, 3, generator=g) * 0.01
    tensors = {"w.weight": q.view(torch.float8_e4m3fn), "w.weight_scale_inv": scale}
    ckpt = open_checkpoint(_write(tmp_path / "fp8", tensors, {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    ours = dequantize(ckpt.tensor("w.weight"))
    theirs = _dequantize_fp8_weight(q.view(torch.float8_e4m3fn).clone(), scale, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)


def test_fp8_partial_blocks_and_e8m0_scales_decode_per_element(tmp_path):
    # DeepSeek-V3 has a 576-row projection: the last row block is partial. transformers' loader
    # refuses such shapes, so the expectation is built element by element from the definition.
    g = torch.Generator().manual_seed(1)
    q = _finite_e4m3(g, 5, 7)
    exponents = torch.tensor([[120, 127, 130], [0, 254, 126]], dtype=torch.uint8)  # E8M0: 2^(b - 127)
    ckpt = open_checkpoint(_write(tmp_path / "fp8", {"w.weight": q.view(torch.float8_e4m3fn),
                                                     "w.weight_scale_inv": exponents},
                                  {"quant_method": "fp8", "weight_block_size": [3, 3]}))
    ours = dequantize(ckpt.tensor("w.weight"))
    values = q.view(torch.float8_e4m3fn).float()
    for n in range(5):
        for k in range(7):
            assert ours[n, k] == values[n, k] * 2.0 ** (int(exponents[n // 3, k // 3]) - 127)


def test_gpt_oss_mxfp4_blocks_decode_as_transformers_converts_them(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)  # [E, rows, K/32, 16]
    scales = torch.randint(110, 140, (2, 6, 3), dtype=torch.uint8, generator=g)  # E8M0
    ckpt = open_checkpoint(_write(tmp_path / "mxfp4", {"mlp.experts.down_proj_blocks": blocks,
                                                       "mlp.experts.down_proj_scales": scales},
                                  {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}))
    assert ckpt.tensor_names() == ["mlp.experts.down_proj"]
    w = ckpt.tensor("mlp.experts.down_proj")
    assert w.fmt == "mxfp4" and w.shape == (2, 6, 96)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]: transposed
    assert torch.equal(dequantize(w), theirs.transpose(1, 2))


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "w8a8", "w8a8-static", "fp8-block", "mxfp4"])
def test_compressed_tensors_checkpoints_decode_as_its_decompressor(tmp_path, scheme):
    dense = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    src = tmp_path / "src"
    _write(src, {"model.layers.0.mlp.up_proj.weight": dense}, {})
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    decompressed = qc.write_compressed_tensors(src, tmp_path / scheme, scheme)  # the library's decompress()
    w = open_checkpoint(tmp_path / scheme).tensor("model.layers.0.mlp.up_proj.weight")
    assert isinstance(w, QuantizedTensor) and w.nbytes < dense.numel() * 4
    assert torch.equal(dequantize(w), decompressed["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize(("strategy", "scale_dtype"), [("group", torch.bfloat16), ("channel", torch.float16)])
def test_compressed_tensors_int8_with_zero_points_decodes_as_its_decompressor_in_its_scale_dtype(
        tmp_path, strategy, scale_dtype):
    # int-quantized, asymmetric: int8 weight_zero_point beside 16-bit scales. compressed-tensors
    # dequantizes (q - zp) * scale in the scale's dtype; zllm's f32 product rounded to it agrees.
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    g = torch.Generator().manual_seed(6)
    n, k, group = 16, 64, 32
    cols = k // group if strategy == "group" else 1
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="int-quantized",
                                input_activations=QuantizationArgs(num_bits=8, type="int", strategy="token",
                                                                   dynamic=True))
    compressor = BaseCompressor.get_value_from_registry("int-quantized")
    state = {"weight": torch.randn(n, k, generator=g),
             "weight_scale": (torch.rand(n, cols, generator=g) * 0.02 + 0.005).to(scale_dtype),
             "weight_zero_point": torch.randint(-20, 20, (n, cols), generator=g, dtype=torch.int8)}
    stored = compressor.compress(state, scheme)
    assert stored["weight"].dtype == torch.int8
    qconfig = {"quant_method": "compressed-tensors", "format": "int-quantized",
               "config_groups": {"group_0": scheme.model_dump(mode="json")}}
    ckpt = open_checkpoint(_write(tmp_path / strategy, {f"m.{part}": t for part, t in stored.items()}, qconfig))
    w = ckpt.tensor("m.weight")
    assert w.fmt == "int8_g" and w.block_shape == (1, group if strategy == "group" else k)
    theirs = compressor.decompress(dict(stored), scheme)["weight"]
    assert theirs.dtype == scale_dtype
    assert torch.equal(dequantize(w).to(scale_dtype), theirs)


def test_modelopt_fp8_decodes_as_weight_times_its_per_tensor_scale(tmp_path):
    # modelopt FP8 (vLLM's ModelOptFp8LinearMethod): e4m3(weight) * weight_scale, one F32 scale a
    # tensor; the older export keeps the recipe in hf_quant_config.json.
    g = torch.Generator().manual_seed(7)
    q = _finite_e4m3(g, 8, 32)
    path = _write(tmp_path / "fp8", {"m.weight": q.view(torch.float8_e4m3fn), "m.weight_scale": torch.tensor(0.0123),
                                     "m.input_scale": torch.tensor(0.5)}, {})
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.19.0"},
                                                           "quantization": {"quant_algo": "FP8",
                                                                            "exclude_modules": ["lm_head"]}}))
    ckpt = open_checkpoint(path)
    assert ckpt.tensor_names() == ["m.weight"] and "m.input_scale" in ckpt.skipped_tensors
    assert torch.equal(dequantize(ckpt.tensor("m.weight")), q.view(torch.float8_e4m3fn).float() * torch.tensor(0.0123))


def test_compressed_tensors_nvfp4_decodes_as_its_decompressor_in_its_bf16(tmp_path):
    # compressed-tensors unpacks NVFP4 to bf16 and divides by weight_global_scale; zllm keeps
    # f32 and multiplies by the reciprocal. Rounded to bf16 the two agree exactly.
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    dense = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    src = tmp_path / "src"
    _write(src, {"model.layers.0.mlp.up_proj.weight": dense}, {})
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    qc.write_compressed_tensors(src, tmp_path / "nvfp4", "nvfp4")
    ckpt = open_checkpoint(tmp_path / "nvfp4")
    w = ckpt.tensor("model.layers.0.mlp.up_proj.weight")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16))
    from safetensors.torch import load_file
    stored = {k.removeprefix("model.layers.0.mlp.up_proj."): v
              for k, v in load_file(str(tmp_path / "nvfp4" / "model.safetensors")).items()}
    theirs = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized").decompress(stored, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(dequantize(w).to(torch.bfloat16), theirs)


def test_e2m1_e8m0_and_e4m3_tables_equal_the_gguf_packages_mxfp4_and_nvfp4():
    import gguf

    rng = np.random.default_rng(5)
    # gguf MXFP4 block: one E8M0 byte, then 16 bytes; byte j holds weight j (low nibble) and
    # weight j + 16 (high nibble). zllm's layout pairs columns (2j, 2j + 1) in a byte instead.
    e = rng.integers(100, 150, size=(8, 1), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(8, 16), dtype=np.uint8)
    theirs = gguf.quants.dequantize(np.concatenate([e, qs], axis=1), gguf.GGMLQuantizationType.MXFP4)  # [8, 32]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [8, 32] codes in weight order
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    ours = dequantize(QuantizedTensor({"qweight": packed, "scales": torch.from_numpy(e)}, "mxfp4", (8, 32)))
    assert torch.equal(ours, torch.from_numpy(theirs))

    # gguf NVFP4 super-block: 4 unsigned-E4M3 bytes, then 4 x 8 bytes; in sub-block s, byte i
    # holds weight i (low nibble) and weight i + 8 (high nibble). No global scale (1.0).
    d = rng.integers(0x08, 0x7F, size=(4, 4), dtype=np.uint8)  # positive normal E4M3 scales
    qs = rng.integers(0, 256, size=(4, 4, 8), dtype=np.uint8)
    theirs = gguf.quants.dequantize(np.concatenate([d, qs.reshape(4, 32)], axis=1), gguf.GGMLQuantizationType.NVFP4)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(4, 64)
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    w = QuantizedTensor({"qweight": packed, "scales": torch.from_numpy(d), "global_scale": torch.tensor(1.0)},
                        "nvfp4", (4, 64))
    assert torch.equal(dequantize(w), torch.from_numpy(theirs))


@settings(max_examples=8, deadline=None)
@given(n8=st.integers(1, 4), groups=st.integers(1, 3), group=st.sampled_from([32, 64]), seed=st.integers(0, 999),
       layout=st.sampled_from(["gptq-int4", "gptq-int8", "gptq-int4-desc-act", "awq-int4", "gptq-int4-v1"]))
def test_packings_written_from_their_definitions_fold_back_to_the_quantizers_weights(
        tmp_path_factory, n8, groups, group, seed, layout):
    # The round trip: zllm's quantizer -> the checkpoint's packing as GPTQ / AWQ define it
    # (tests/quant_checkpoints.py, bit layouts commented there) -> zllm's fold -> the reference.
    src = tmp_path_factory.mktemp("src")
    dense = torch.randn(8 * n8, group * groups, generator=torch.Generator().manual_seed(seed))
    save_file({"model.layers.0.mlp.up_proj.weight": dense}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    dst = tmp_path_factory.mktemp("dst")
    if layout.startswith("awq"):
        expected = qc.write_awq(src, dst, group)
    else:
        bits = 8 if "int8" in layout else 4
        expected = qc.write_gptq(src, dst, bits, group, "gptq" if layout.endswith("v1") else "gptq_v2",
                                 desc_act=layout.endswith("desc-act"), seed=seed)
    w = open_checkpoint(dst).tensor("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(dequantize(w), expected["model.layers.0.mlp.up_proj.weight"])
