"""Folding a quantized HF checkpoint's tensors into one logical weight: hand-built packed words
whose bit layout is spelled out (GPTQ, AWQ, compressed-tensors pack-quantized: no library
decodes them on a CPU), what the checkpoint lists, and bad input named before the first token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zllm.domain.quant import dequantize
from zllm.spec.errors import CheckpointError, TensorError
from zllm.spec.tensor_spec import Shard, TensorSpec
from zllm.weights import load_weights, open_checkpoint

N = K = 8  # one 32-bit word of 4-bit values along either dimension


def _write(path: Path, tensors: dict[str, torch.Tensor], qconfig: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qconfig}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _word(nibbles: list[int]) -> int:
    """Eight 4-bit values, value ``i`` at bits ``4i`` of a little-endian int32 (as a signed int)."""
    w = sum(v << (4 * i) for i, v in enumerate(nibbles))
    return w - (1 << 32) if w >= 1 << 31 else w


Q = [[(3 * n + k) % 16 for k in range(K)] for n in range(N)]  # q[n][k], unsigned 4-bit
Z = [n + 1 for n in range(N)]  # zero point of row n (one group of K = 8)
S = [0.5 + n / 8 for n in range(N)]  # scale of row n (exact in f16)
EXPECTED = torch.tensor([[S[n] * (Q[n][k] - Z[n]) for k in range(K)] for n in range(N)])


def _gptq_tensors(version: str) -> dict[str, torch.Tensor]:
    # qweight [K/8, N]: word [0, n] packs column n's 8 values along K: q[n][k] at bits 4k.
    qweight = torch.tensor([[_word(Q[n]) for n in range(N)]], dtype=torch.int32)
    # qzeros [K/g, N/8]: one word packs the 8 rows' zero points along N; v1 stores z - 1.
    stored = [z - 1 for z in Z] if version == "gptq" else Z
    return {"m.qweight": qweight, "m.qzeros": torch.tensor([[_word(stored)]], dtype=torch.int32),
            "m.scales": torch.tensor([S], dtype=torch.float16), "m.g_idx": torch.zeros(K, dtype=torch.int32)}


@pytest.mark.parametrize("version", ["gptq", "gptq_v2"])
def test_gptq_words_unpack_to_scale_times_q_minus_zero(tmp_path, version):
    ckpt = open_checkpoint(_write(tmp_path, _gptq_tensors(version), {
        "quant_method": "gptq", "bits": 4, "group_size": K, "desc_act": False, "sym": False,
        "checkpoint_format": version}))
    assert ckpt.tensor_names() == ["m.weight"]
    assert ckpt.quantization == "gptq: 1 weight as int4_g; the rest dense"
    assert ckpt.tensor_shape_format("m.weight") == ((N, K), "int4_g")
    w = ckpt.tensor("m.weight")
    assert torch.equal(dequantize(w), EXPECTED)
    assert w.nbytes == ckpt.tensor_nbytes("m.weight") == N * K // 2 + N * 4 + N  # qweight + f32 scales + u8 zeros


def test_gptq_act_order_g_idx_becomes_a_column_permutation(tmp_path):
    # desc_act: K = 8 columns in groups of 4 by g_idx; columns 1, 3, 5, 7 form group 0.
    g_idx = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.int32)
    scales = torch.tensor([[1.0] * N, [2.0] * N], dtype=torch.float16)  # [K/g, N]: group 1 doubles
    zeros = torch.tensor([[_word([8] * N)], [_word([8] * N)]], dtype=torch.int32)  # v2: z = 8
    tensors = {"m.qweight": torch.tensor([[_word(Q[n]) for n in range(N)]], dtype=torch.int32),
               "m.qzeros": zeros, "m.scales": scales, "m.g_idx": g_idx}
    ckpt = open_checkpoint(_write(tmp_path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 4,
                                                      "desc_act": True, "checkpoint_format": "gptq_v2"}))
    w = ckpt.tensor("m.weight")
    assert w.parts["perm"].tolist() == [1, 3, 5, 7, 0, 2, 4, 6]  # stored column j is logical column perm[j]
    expected = torch.tensor([[(2.0 if g_idx[k] else 1.0) * (Q[n][k] - 8) for k in range(K)] for n in range(N)])
    assert torch.equal(dequantize(w), expected)


def test_awq_interleaved_words_unpack_in_logical_column_order(tmp_path):
    # AWQ packs along N: nibble i of word [k, 0] holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i].
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    qweight = torch.tensor([[_word([Q[order[i]][k] for i in range(8)])] for k in range(K)], dtype=torch.int32)
    qzeros = torch.tensor([[_word([Z[order[i]] for i in range(8)])]], dtype=torch.int32)
    ckpt = open_checkpoint(_write(tmp_path, {"m.qweight": qweight, "m.qzeros": qzeros,
                                             "m.scales": torch.tensor([S], dtype=torch.float16)},
                                  {"quant_method": "awq", "bits": 4, "group_size": K, "version": "gemm",
                                   "zero_point": True}))
    assert torch.equal(dequantize(ckpt.tensor("m.weight")), EXPECTED)


def test_compressed_tensors_pack_quantized_words_and_row_packed_zero_points(tmp_path):
    # weight_packed [N, K/8]: row n's 8 values along K, stored as value + 8 (here q - 8 + 8 = q);
    # weight_zero_point [ceil(N/8), K/g]: one word holds the 8 rows' zero points (+ 8), packed along N.
    tensors = {"m.weight_packed": torch.tensor([[_word(Q[n])] for n in range(N)], dtype=torch.int32),
               "m.weight_shape": torch.tensor([N, K]),
               "m.weight_scale": torch.tensor(S).reshape(N, 1),
               "m.weight_zero_point": torch.tensor([[_word(Z)]], dtype=torch.int32)}
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                           "strategy": "group", "group_size": K}}}}
    w = open_checkpoint(_write(tmp_path, tensors, qconfig)).tensor("m.weight")
    assert torch.equal(dequantize(w), EXPECTED)


def test_activation_scales_are_skipped_with_the_reason_and_strays_stay_unused(tmp_path):
    q = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    path = _write(tmp_path, {"a.weight": q, "a.weight_scale": torch.tensor(1.0), "a.input_scale": torch.tensor(1.0),
                             "b.weight_scale_inv": torch.ones(1, 1)}, {"quant_method": "fp8"})
    ckpt = open_checkpoint(path)
    assert "a.input_scale" in ckpt.skipped_tensors and "f32 activations" in ckpt.skipped_tensors["a.input_scale"]
    assert sorted(ckpt.tensor_names()) == ["a.weight", "b.weight_scale_inv"]
    with pytest.raises(TensorError, match="'b.weight_scale_inv': unused"):
        load_weights(ckpt, {"a.weight": TensorSpec((4, 32))})


# ------------------------------------------------------------------------- bad input


def _gptq(tmp_path: Path, drop: str | None = None, **changes) -> Path:
    tensors = _gptq_tensors("gptq_v2")
    if drop:
        del tensors[drop]
    tensors.update(changes.pop("tensors", {}))
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": K, "checkpoint_format": "gptq_v2", **changes}
    return _write(tmp_path, tensors, qconfig)


@pytest.mark.parametrize(("qconfig", "named"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; supported: fp8, "),
    ({"quant_method": "fbgemm_fp8"}, "'fbgemm_fp8'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "weird": 1}, "unknown field 'weird'"),
    # true counts as 1 in Python: a block of one row was read from it.
    ({"quant_method": "fp8", "weight_block_size": [True, 128]},
     "weight_block_size must be [rows, cols], two positive integers, got [True, 128]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": True}, "group_size must be a positive integer or -1, got True"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1.0}, "group_size must be a positive integer or -1, got -1.0"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "version 'exllama' is not supported; supported: gemm"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     "format 'marlin-24' (config_groups.g) is not supported; supported: float-quantized, int-quantized, "
     "naive-quantized, "),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
     "quant_algo 'W4A8_AWQ' is not supported; supported: FP8, NVFP4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "kv_cache_quant_algo 'NVFP4' is not supported; supported: 'FP8' or float 8-bit QuantizationArgs"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
      "kv_cache_scheme": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}},
     "kv_cache_scheme int 8-bit (strategy 'tensor', symmetric True) is not supported: an FP8 KV cache"),
    ({"quant_method": "fp8", "kv_cache_scheme": "dynamic"},
     "kv_cache_scheme 'dynamic' is not supported; supported: 'static' or "),
])
def test_unknown_method_format_or_field_names_it_and_lists_what_is_supported(tmp_path, qconfig, named):
    path = _write(tmp_path, {"x.weight": torch.zeros(2, 2)}, qconfig)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(path / "config.json") in str(err.value) and named in str(err.value)


@pytest.mark.parametrize("group_size", [None, 0, -1, "32", 2.5])
def test_group_strategy_without_a_positive_group_size_is_a_config_error(tmp_path, group_size):
    # It was read as one group per row, and failed later on the scale's shape.
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    if group_size is not None:
        weights["group_size"] = group_size
    path = _write(tmp_path, {"m.weight_packed": torch.zeros(N, 1, dtype=torch.int32),
                             "m.weight_shape": torch.tensor([N, K]), "m.weight_scale": torch.ones(N, 1)},
                  {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == (f"{path / 'config.json'}: quantization_config: config_groups.g.weights: strategy "
                              f"'group' needs a group_size that is a positive integer, got {group_size!r}")


@pytest.mark.parametrize(("targets", "what"), [
    # re.error escaped as a traceback; a string was read as its letters, each a class name.
    (["re:(bad"], "'re:(bad' is not a valid regular expression: missing ), unterminated subpattern at position 0"),
    ([5], "5 is not a string"),
    ("Linear", "'Linear' is not a list"),
])
def test_config_group_target_that_is_not_a_name_or_regular_expression_is_a_config_error(tmp_path, targets, what):
    path = _write(tmp_path, {"m.weight_packed": torch.zeros(N, 1, dtype=torch.int32),
                             "m.weight_shape": torch.tensor([N, K]), "m.weight_scale": torch.ones(N, 1)},
                  {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                      "targets": targets, "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == f"{path / 'config.json'}: quantization_config: config_groups.g.targets: {what}"


def _ct_pack_config(**weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel", **weights}}}}


@pytest.mark.parametrize(("qconfig", "what"), [
    # A list of groups was an AttributeError; a group or its weights given as a string had its
    # letters listed as unknown fields.
    ({**_ct_pack_config(), "config_groups": [{"targets": ["Linear"]}]},
     "config_groups must be an object of named groups, got list"),
    ({**_ct_pack_config(), "config_groups": {"g": "W4A16"}}, "config_groups.g must be an object, got str 'W4A16'"),
    ({**_ct_pack_config(), "config_groups": {"g": {"targets": ["Linear"], "weights": "int4"}}},
     "config_groups.g.weights must be an object, got str 'int4'"),
    ({**_ct_pack_config(), "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"},
                                                   "input_activations": "int8"}}},
     "config_groups.g.input_activations must be an object, got str 'int8'"),
    # int("four") raised ValueError; 4.5 bits were read as 4.
    (_ct_pack_config(num_bits="four"), "config_groups.g.weights.num_bits must be a positive integer, got 'four'"),
    (_ct_pack_config(num_bits=4.5), "config_groups.g.weights.num_bits must be a positive integer, got 4.5"),
    (_ct_pack_config(num_bits=True), "config_groups.g.weights.num_bits must be a positive integer, got True"),
    # A zero block was a ZeroDivisionError, a string one a ValueError.
    ({**_ct_pack_config(), "format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [0, 32]}}}},
     "strategy 'block': block_structure must be [rows, cols], two positive integers, got [0, 32]"),
    ({**_ct_pack_config(), "format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": ["a", 32]}}}},
     "strategy 'block': block_structure must be [rows, cols], two positive integers, got ['a', 32]"),
])
def test_compressed_tensors_config_of_the_wrong_shape_is_a_config_error_naming_the_field(tmp_path, qconfig, what):
    tensors = {"m.weight_packed": torch.zeros(N, 1, dtype=torch.int32), "m.weight_shape": torch.tensor([N, K]),
               "m.weight_scale": torch.ones(N, 1)}
    if qconfig.get("format") == "float-quantized":
        tensors = {"m.weight": torch.zeros(N, K, dtype=torch.float8_e4m3fn), "m.weight_scale": torch.ones(1, 1)}
    path = _write(tmp_path, tensors, qconfig)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == f"{path / 'config.json'}: quantization_config: {what}"


@pytest.mark.parametrize("status", ["frozen", "decompressed"])
def test_compressed_tensors_checkpoint_saved_uncompressed_is_a_config_error(tmp_path, status):
    # Dense weights with their scales, meant to be quantized and dequantized in each forward: the
    # scales failed as unused, or the dense weights were called unquantized.
    path = _write(tmp_path, {"m.weight": torch.zeros(N, K), "m.weight_scale": torch.ones(N, 1)},
                  {**_ct_pack_config(), "quantization_status": status})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == (f"{path / 'config.json'}: quantization_config: quantization_status {status!r} (weights "
                              "saved uncompressed, fake-quantized) is not supported; supported: 'compressed'")


@pytest.mark.parametrize(("qconfig", "what"), [
    # bool("false") is True: each was read as true.
    ({"quant_method": "gptq", "bits": 4, "group_size": K, "desc_act": "yes"}, "desc_act 'yes'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": K, "sym": "no"}, "sym 'no'"),
    ({"quant_method": "awq", "bits": 4, "group_size": K, "version": "gemm", "zero_point": "false"},
     "zero_point 'false'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel",
                                           "symmetric": "false"}}}},
     "config_groups.g.weights.symmetric 'false'"),
])
def test_flag_that_is_not_true_or_false_is_a_config_error(tmp_path, qconfig, what):
    path = _write(tmp_path, {"x.weight": torch.zeros(2, 2)}, qconfig)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == f"{path / 'config.json'}: quantization_config: {what} is not true or false"


def _w8a8(tmp_path: Path, drop: str | None = None, symmetric: bool = True, **changes) -> Path:
    """compressed-tensors int-quantized W8A8: int8 weight [N, K], weight_scale [N, 1] per channel."""
    tensors = {"m.weight": torch.tensor(Q, dtype=torch.int8) - 8, "m.weight_scale": torch.tensor(S).reshape(N, 1)}
    if drop:
        del tensors[drop]
    tensors.update(changes.pop("tensors", {}))
    int8 = {"num_bits": 8, "type": "int", "symmetric": symmetric}
    qconfig = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
        "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}
    return _write(tmp_path, tensors, qconfig)


def _modelopt_fp8(tmp_path: Path, drop: str | None = None, **changes) -> Path:
    tensors = {"m.weight": torch.zeros(N, K, dtype=torch.float8_e4m3fn), "m.weight_scale": torch.tensor(0.5),
               "m.input_scale": torch.tensor(1.0)}
    if drop:
        del tensors[drop]
    tensors.update(changes.pop("tensors", {}))
    return _write(tmp_path, tensors, {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]})


def test_w8a8_int8_weights_fold_to_int8_g_with_the_activation_note(tmp_path):
    # int8 v is stored offset by 128 against a zero point of 128: (v + 128) - 128 = v, exactly.
    ckpt = open_checkpoint(_w8a8(tmp_path))
    w = ckpt.tensor("m.weight")
    assert w.fmt == "int8_g" and w.nbytes == ckpt.tensor_nbytes("m.weight") == N * K + N * 4 + N
    assert torch.equal(dequantize(w), torch.tensor([[S[n] * (Q[n][k] - 8) for k in range(K)] for n in range(N)]))
    assert ckpt.quantization_notes == (
        "activations kept in f32, not quantized to int8 per token (dynamic) as the checkpoint's config says: its "
        "weights run weight-only (dequantized-weight semantics, not the quantized-activation matmul)",)


@pytest.mark.parametrize(("build", "tensor", "what"), [
    (lambda p: _gptq(p, drop="m.qzeros"), "m.qweight", "qzeros 'm.qzeros' is missing"),
    (lambda p: _gptq(p, tensors={"m.scales": torch.ones(1, 4, dtype=torch.float16)}), "m.scales",
     "shape [1, 4]; expected [1, 8]"),
    (lambda p: _gptq(p, tensors={"m.g_idx": torch.zeros(6, dtype=torch.int32)}), "m.g_idx", "expected [8]"),
    (lambda p: _gptq(p, group_size=3), "m.qweight", "group size 3 does not divide K = 8"),
    (lambda p: _write(p, {"m.weight": torch.zeros(4, 32, dtype=torch.float8_e4m3fn)},
                      {"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "m.weight", "FP8 weight with no scale"),
    (lambda p: _write(p, {"m.weight": torch.zeros(4, 32, dtype=torch.float8_e4m3fn),
                          "m.weight_scale_inv": torch.ones(2, 2)},
                      {"quant_method": "fp8", "weight_block_size": [2, 8]}),
     "m.weight_scale_inv", "scale shape [2, 2] fits neither"),
    (lambda p: _write(p, {"m.weight_packed": torch.zeros(8, 2, dtype=torch.int32),
                          "m.weight_shape": torch.tensor([8, 8]), "m.weight_scale": torch.ones(8, 1)},
                      {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                          "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}),
     "m.weight_packed", "packed shape [8, 2] disagrees with weight_shape [8, 8]"),
    (lambda p: _w8a8(p, drop="m.weight_scale"), "m.weight", "scale 'm.weight_scale' is missing"),
    (lambda p: _w8a8(p, tensors={"m.weight_scale": torch.ones(N)}), "m.weight_scale",
     "scale has shape [8]; expected [8, 1] for strategy 'channel'"),
    (lambda p: _w8a8(p, tensors={"m.weight_scale": torch.ones(N, 1, dtype=torch.int32)}), "m.weight_scale",
     "scale stored as I32; expected F32 or F16 or BF16"),
    (lambda p: _w8a8(p, symmetric=False), "m.weight", "zero point 'm.weight_zero_point' is missing"),
    (lambda p: _modelopt_fp8(p, drop="m.weight_scale"), "m.weight", "FP8 per-tensor scale 'm.weight_scale' is missing"),
    (lambda p: _modelopt_fp8(p, tensors={"m.weight_scale": torch.ones(N, 1)}), "m.weight_scale",
     "modelopt FP8 has one scale per tensor"),
])
def test_bad_quantized_tensors_name_the_file_the_tensor_and_the_problem(tmp_path, build, tensor, what):
    path = build(tmp_path)
    with pytest.raises(TensorError) as err:
        open_checkpoint(path)
    assert err.value.tensor == tensor and str(path / "model.safetensors") in str(err.value) and what in str(err.value)


def _ct(fmt: str, weights: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}


@pytest.mark.parametrize(("tensors", "qconfig", "tensor", "what"), [
    # Each was a ValueError unpacking the shape, or a ZeroDivisionError on K = 0.
    ({"m.weight": torch.zeros(64, dtype=torch.float8_e4m3fn), "m.weight_scale": torch.ones(1)},
     _ct("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"}),
     "m.weight", "FP8 weight of shape [64]; quantized weights have rows"),
    ({"m.weight_packed": torch.zeros(64, dtype=torch.uint8), "m.weight_scale": torch.ones(8).to(torch.float8_e4m3fn),
      "m.weight_global_scale": torch.ones(1)},
     _ct("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
     "m.weight_packed", "packed FP4 weight of shape [64]; expected [..., N, K/2]"),
    ({"m.weight": torch.zeros(64, dtype=torch.uint8), "m.weight_scale": torch.ones(8).to(torch.float8_e4m3fn),
      "m.weight_scale_2": torch.tensor(1.0)},
     {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
     "m.weight", "NVFP4 weight of shape [64]; expected [..., N, K/2]"),
    ({"m.weight_packed": torch.zeros(N, 0, dtype=torch.int32), "m.weight_shape": torch.tensor([N, 0]),
      "m.weight_scale": torch.ones(N, 1)},
     _ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "channel"}),
     "m.weight_shape", "weight_shape [8, 0] is not a shape: both sizes must be positive"),
])
def test_quantized_weight_without_rows_and_columns_is_named(tmp_path, tensors, qconfig, tensor, what):
    path = _write(tmp_path, tensors, qconfig)
    with pytest.raises(TensorError) as err:
        open_checkpoint(path)
    assert err.value.tensor == tensor and str(path / "model.safetensors") in str(err.value) and what in str(err.value)


@pytest.mark.parametrize("qconfig", [
    {"quant_method": "fp8", "weight_block_size": [128, 128]},
    {"quant_method": "gptq", "bits": 4, "group_size": 128},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    _ct("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "channel"}),
    {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    {"quant_method": "mxfp4"},
], ids=lambda q: q["quant_method"])
def test_config_that_quantizes_weights_over_only_dense_tensors_is_a_config_error(tmp_path, qconfig):
    # A dequantized copy that kept its quantization_config ran dense under the config's label.
    path = _write(tmp_path, {"lm_head.weight": torch.zeros(N, K), "model.layers.0.m.weight": torch.zeros(
        N, K, dtype=torch.bfloat16)}, qconfig)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value) == (f"{path / 'config.json'}: quantization_config says quant_method "
                              f"{qconfig['quant_method']!r}, but no tensor is stored as it quantizes "
                              "(model.layers.0.m.weight is stored as BF16); remove quantization_config to load the "
                              "weights dense")


def test_fp8_config_over_e5m2_weights_names_one(tmp_path):
    path = _write(tmp_path, {"lm_head.weight": torch.zeros(N, K),
                             "model.layers.0.m.weight": torch.zeros(N, K, dtype=torch.float8_e5m2)},
                  {"quant_method": "fp8"})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(err.value).endswith("but no tensor is stored as it quantizes (model.layers.0.m.weight is stored as "
                                   "F8_E5M2)")


def test_dense_weight_stored_beside_its_quantized_parts_is_named(tmp_path):
    # The folded weight shadowed the dense one, which was neither read nor reported unused.
    path = _gptq(tmp_path, tensors={"m.weight": torch.zeros(N, K, dtype=torch.bfloat16)})
    with pytest.raises(TensorError) as err:
        open_checkpoint(path)
    assert err.value.tensor == "m.weight" and str(path / "model.safetensors") in str(err.value)
    assert "stored beside the quantized parts of the same weight (m.qweight, m.qzeros, m.scales" in str(err.value)


def test_weight_in_a_dtype_the_method_does_not_fold_does_not_ask_for_a_quantization_config(tmp_path):
    # It said "quantized weights need config.json's quantization_config" beside one.
    path = _write(tmp_path, {"a.weight": torch.zeros(N, K, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(
        1), "b.weight": torch.zeros(N, K, dtype=torch.float8_e5m2)}, {"quant_method": "fp8"})
    with pytest.raises(TensorError) as err:
        load_weights(open_checkpoint(path), {"a.weight": TensorSpec((N, K)), "b.weight": TensorSpec((N, K))})
    assert err.value.tensor == "b.weight"
    assert str(err.value).endswith("stored as F8_E5M2; supported safetensors dtypes: F32, F16, BF16 "
                                   "(quantization_config's quant_method 'fp8' does not quantize it so)")


def test_config_that_quantizes_only_the_kv_cache_loads_dense_weights(tmp_path):
    qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}}
    ckpt = open_checkpoint(_write(tmp_path, {"m.weight": torch.zeros(N, K)}, qconfig))
    assert ckpt.quantization == "compressed-tensors: no quantized weights; the rest dense"


def test_nan_scale_is_named_when_the_weight_loads(tmp_path):
    tensors = _gptq_tensors("gptq_v2")
    tensors["m.scales"][0, 3] = float("nan")
    ckpt = open_checkpoint(_write(tmp_path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": K,
                                                      "checkpoint_format": "gptq_v2"}))
    # the index is the stored tensor's ([K/g, N]), not the transposed [N, K/g] the kernels get
    with pytest.raises(TensorError, match=r"'m.scales': NaN scale at index \[0, 3\]"):
        load_weights(ckpt, {"m.weight": TensorSpec((N, K))})


@pytest.mark.parametrize(("build", "tensor", "what"), [
    (lambda p: _gptq(p, tensors={"m.scales": torch.tensor([S[:3] + [-float("inf")] + S[4:]], dtype=torch.float16)}),
     "m.scales", "infinite scale at index [0, 3] (1 infinite of 8)"),
    (lambda p: _w8a8(p, tensors={"m.weight_scale": torch.tensor(S[:5] + [float("inf")] + S[6:]).reshape(N, 1)}),
     "m.weight_scale", "infinite scale at index [5, 0] (1 infinite of 8)"),
    (lambda p: _modelopt_fp8(p, tensors={"m.weight_scale": torch.tensor(float("inf"))}),
     "m.weight_scale", "infinite scale at index [] (1 infinite of 1)"),
])
def test_infinite_scale_is_named_when_the_weight_loads(tmp_path, build, tensor, what):
    # An inf scale decodes to inf and NaN weights: the run gave empty text and no error.
    ckpt = open_checkpoint(build(tmp_path))
    with pytest.raises(TensorError) as err:
        load_weights(ckpt, {"m.weight": TensorSpec((N, K))})
    assert err.value.tensor == tensor and what in str(err.value)


def test_modelopt_export_without_quantization_config_reads_hf_quant_config(tmp_path):
    # Older modelopt exports keep the recipe in hf_quant_config.json, not in config.json.
    packed = torch.full((2, 8), 0x72, dtype=torch.uint8)  # codes 2 (1.0) low, 7 (6.0) high
    path = _write(tmp_path, {"m.weight": packed, "m.weight_scale": torch.full((2, 1), 0x38, dtype=torch.uint8).view(
        torch.float8_e4m3fn), "m.weight_scale_2": torch.tensor(0.5), "m.input_scale": torch.tensor(1.0)}, {})
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    ckpt = open_checkpoint(path)
    assert path / "hf_quant_config.json" in ckpt.files
    assert dequantize(ckpt.tensor("m.weight")).tolist() == [[0.5, 3.0] * 8] * 2


def test_gptq_v1_8_bit_zero_point_255_is_refused_naming_qzeros(tmp_path):
    # 8 bits: four values per word. v1 stores z - 1, so a stored 255 means z = 256: no 8-bit value.
    tensors = {"m.qweight": torch.tensor([[0x04030201] * 4], dtype=torch.int32),  # [K/4, N]: K = 4
               "m.qzeros": torch.tensor([[0x7F7F7FFF]], dtype=torch.int32),  # zeros 255, 127, 127, 127
               "m.scales": torch.ones(1, 4, dtype=torch.float16)}
    ckpt = open_checkpoint(_write(tmp_path, tensors, {"quant_method": "gptq", "bits": 8, "group_size": 4,
                                                      "checkpoint_format": "gptq"}))
    with pytest.raises(TensorError, match=r"'m.qzeros': a GPTQ v1 zero point of 255 \+ 1 does not fit 8 bits"):
        ckpt.tensor("m.weight")


def test_compressed_tensors_act_order_g_idx_becomes_a_column_permutation(tmp_path):
    # actorder "group": weight_g_idx [K] assigns columns to groups; odd columns form group 0.
    g_idx = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.int32)
    scales = torch.tensor([[1.0, 2.0]] * N)  # [N, K/g]: group 1 doubles
    tensors = {"m.weight_packed": torch.tensor([[_word(Q[n])] for n in range(N)], dtype=torch.int32),
               "m.weight_shape": torch.tensor([N, K]), "m.weight_scale": scales, "m.weight_g_idx": g_idx}
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 4, "actorder": "group"}}}}
    w = open_checkpoint(_write(tmp_path, tensors, qconfig)).tensor("m.weight")
    assert w.parts["perm"].tolist() == [1, 3, 5, 7, 0, 2, 4, 6]
    expected = torch.tensor([[(2.0 if g_idx[k] else 1.0) * (Q[n][k] - 8) for k in range(K)] for n in range(N)])
    assert torch.equal(dequantize(w), expected)


# ------------------------------------------------------------------------- FP8 KV-cache scales


_ATTN = "model.layers.0.self_attn."
_FP8_KV_CACHE = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


_PROJ = {_ATTN + p + ".weight": TensorSpec((4, 4)) for p in ("q_proj", "k_proj", "v_proj")}


def _kv_checkpoint(tmp_path: Path, qconfig: dict, scales: dict[str, torch.Tensor]) -> Path:
    """A layer whose attention module holds dense q/k/v projections (every method leaves them as
    they are) and ``scales``."""
    return _write(tmp_path, {**{name: torch.zeros(4, 4) for name in _PROJ}, **scales}, qconfig)


@pytest.mark.parametrize(("qconfig", "scales", "scheme"), [
    # modelopt's hf_quant_config.json (and older config.json): scales on k_proj / v_proj.
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
     {"k_proj.k_scale": torch.tensor(0.5), "v_proj.v_scale": torch.tensor(0.25)}, "kv_cache_quant_algo: FP8"),
    # modelopt's newer config.json restates it as QuantizationArgs.
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": _FP8_KV_CACHE},
     {"k_proj.k_scale": torch.tensor(0.5), "v_proj.v_scale": torch.tensor(0.25)},
     "kv_cache_scheme: float8 per tensor"),
    # compressed-tensors attn_head: one scale per KV head, on the attention module.
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
      "kv_cache_scheme": {**_FP8_KV_CACHE, "strategy": "attn_head"}},
     {"k_scale": torch.ones(2, 1, 1), "v_scale": torch.ones(2, 1, 1, dtype=torch.bfloat16)},
     "kv_cache_scheme: float8 per KV head"),
    # AutoFP8: kv_cache_scheme "static", scales moved from k_proj / v_proj onto the attention module.
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
      "kv_cache_scheme": "static"},
     {"k_scale": torch.tensor([0.5]), "v_scale": torch.tensor([0.25])}, "kv_cache_scheme: static"),
], ids=["modelopt-kv_cache_quant_algo", "modelopt-kv_cache_scheme", "compressed-tensors-attn_head", "autofp8-static"])
def test_fp8_kv_cache_scales_are_skipped_as_known_when_the_config_declares_the_cache(tmp_path, qconfig, scales,
                                                                                      scheme):
    ckpt = open_checkpoint(_kv_checkpoint(tmp_path, qconfig, {_ATTN + k: v for k, v in scales.items()}))
    assert sorted(ckpt.tensor_names()) == sorted(_PROJ)
    assert sorted(ckpt.skipped_tensors) == sorted(_ATTN + k for k in scales)
    assert all(why.startswith("FP8 KV-cache scale: not applied") for why in ckpt.skipped_tensors.values())
    assert ckpt.kv_cache_quantization == scheme
    load_weights(ckpt, _PROJ)


def test_kv_scales_stay_unused_strays_without_a_declared_cache_or_off_a_module_with_weights(tmp_path):
    fp8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
    q_fp8 = {_ATTN + "q_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
             _ATTN + "q_proj.weight_scale": torch.tensor(1.0)}  # one quantized weight, as the config says
    ckpt = open_checkpoint(_kv_checkpoint(tmp_path / "a", fp8, {**q_fp8, _ATTN + "k_scale": torch.tensor(0.5)}))
    assert ckpt.kv_cache_quantization is None and ckpt.skipped_tensors == {}
    with pytest.raises(TensorError, match=r"'model.layers.0.self_attn.k_scale': unused"):
        load_weights(ckpt, _PROJ)
    # The config declares the cache, but "model.layers.1.self_attn" holds nothing else.
    ckpt = open_checkpoint(_kv_checkpoint(tmp_path / "b", {**fp8, "kv_cache_quant_algo": "FP8"},
                                          {"model.layers.1.self_attn.k_scale": torch.tensor(0.5)}))
    assert ckpt.skipped_tensors == {}
    with pytest.raises(TensorError, match=r"'model.layers.1.self_attn.k_scale': unused"):
        load_weights(ckpt, _PROJ)


@pytest.mark.parametrize(("scale", "what"), [
    (torch.ones(4, 4), "KV-cache scale has shape [4, 4]; expected one value per tensor or one per KV head"),
    (torch.tensor(1, dtype=torch.int32), "KV-cache scale stored as I32; expected F32 or F16 or BF16"),
], ids=["a-scale-per-element", "int32"])
def test_a_bad_kv_cache_scale_is_named(tmp_path, scale, what):
    path = _kv_checkpoint(tmp_path, {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
                          {_ATTN + "k_proj.k_scale": scale})
    with pytest.raises(TensorError) as err:
        open_checkpoint(path)
    assert err.value.tensor == _ATTN + "k_proj.k_scale" and what in str(err.value)


def test_naive_quantized_int8_weights_fold_as_int_quantized_ones_without_an_activation_note(tmp_path):
    # naive-quantized is compressed-tensors' unpacked layout (int-quantized is an alias of it):
    # I8 weight [N, K] and weight_scale [N, 1]; weight-only, so no activation is quantized.
    tensors = {"m.weight": torch.tensor(Q, dtype=torch.int8) - 8, "m.weight_scale": torch.tensor(S).reshape(N, 1)}
    qconfig = {"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}
    ckpt = open_checkpoint(_write(tmp_path, tensors, qconfig))
    w = ckpt.tensor("m.weight")
    assert w.fmt == "int8_g" and ckpt.quantization_notes == ()
    assert torch.equal(dequantize(w), torch.tensor([[S[n] * (Q[n][k] - 8) for k in range(K)] for n in range(N)]))


def test_folded_weight_with_a_whole_shard_loads_folded_and_a_split_one_is_refused(tmp_path):
    # A family's vocabulary shard on one rank is the whole tensor: it was refused as a split, and
    # tensor_slice read the raw F8 part instead of the folded weight.
    ckpt = open_checkpoint(_modelopt_fp8(tmp_path))
    whole = load_weights(ckpt, {"m.weight": TensorSpec((N, K), shard=Shard(0, 0, N))})["m.weight"]
    assert torch.equal(dequantize(whole), dequantize(ckpt.tensor("m.weight")))
    with pytest.raises(TensorError, match="cannot be split for tensor parallelism yet"):
        load_weights(ckpt, {"m.weight": TensorSpec((N, K), shard=Shard(0, 0, N // 2))})
