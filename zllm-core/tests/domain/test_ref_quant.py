"""Reference dequantization vs the ``gguf`` package, bit for bit (NaN-aware), and vs hand-built
blocks; N-D (expert) weights decode per slice."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.quant import (
    dequantize,
    dequantize_q4_0,
    dequantize_q4_1,
    dequantize_q5_0,
    dequantize_q5_1,
    dequantize_q8_0,
)
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor

BLOCKS_32 = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
GGML_TYPE = {fmt: gguf.GGMLQuantizationType[fmt.upper()] for fmt in BLOCK_LAYOUTS}
# byte offsets of the f16 fields (scale d, and min m where the format has one) of a 32-weight block
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2)}
# f16 bit patterns worth forcing into the scale: +inf, -inf, qNaN, sNaN payload, min subnormal, -0, 1.0, f16 max
SPECIAL_F16_BITS = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x8000, 0x3C00, 0x7BFF]


def assert_bitwise_equal_nan_aware(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    # every non-NaN value identical down to the bit (so -0.0 vs 0.0 would fail too)
    assert torch.equal(actual[~nan_a].view(torch.int32), expected[~nan_e].view(torch.int32))


@st.composite
def quantized_bytes(draw, fmt: str) -> tuple[np.ndarray, int, int]:
    """Random raw rows of ``fmt`` blocks; scales (and mins) are random bits or forced special values."""
    layout = BLOCK_LAYOUTS[fmt]
    rows = draw(st.integers(1, 4))
    n_blocks = draw(st.integers(1, 4))
    raw = np.frombuffer(
        draw(st.binary(min_size=rows * n_blocks * layout.type_size, max_size=rows * n_blocks * layout.type_size)),
        dtype=np.uint8,
    )
    raw = raw.copy().reshape(rows, n_blocks, layout.type_size)
    for offset in F16_FIELDS[fmt]:
        bits = draw(st.lists(st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL_F16_BITS)),
                             min_size=rows * n_blocks, max_size=rows * n_blocks))
        raw[..., offset:offset + 2] = np.array(bits, dtype="<u2").reshape(rows, n_blocks, 1).view(np.uint8)
    return raw.reshape(rows, n_blocks * layout.type_size), rows, n_blocks * layout.block_size


def _check_against_gguf(fmt: str, sample: tuple[np.ndarray, int, int]) -> None:
    raw, rows, cols = sample
    with np.errstate(invalid="ignore"):  # inf * 0 -> NaN is part of what is being compared
        expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGML_TYPE[fmt]), dtype=np.float32))
    expected = expected.reshape(rows, cols)
    w = QuantizedTensor(torch.from_numpy(raw.copy()), fmt, (rows, cols))
    assert_bitwise_equal_nan_aware(dequantize(w), expected)


@pytest.mark.parametrize("fmt", BLOCKS_32)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_32_weight_block_formats_match_gguf_exactly(fmt, data):
    _check_against_gguf(fmt, data.draw(quantized_bytes(fmt)))


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1"])
def test_blocks_from_the_gguf_quantizer_decode_as_gguf_decodes_them_within_a_step(fmt):
    # gguf-py's quantizer is llama.cpp's quantize_row_*_ref: round to the nearest of the block's
    # 16 (32) levels, so each decoded weight is within d / 2 of the original (plus f16 rounding of
    # d and m) — except q5_0, whose levels d * (q - 16) with d = max / -16 reach the block's
    # largest magnitude on one side only: the other side clips at q = 31, up to d off
    rng = np.random.default_rng(7)
    w32 = rng.standard_normal((9, 32 * 5)).astype(np.float32)
    raw = gguf.quants.quantize(w32, GGML_TYPE[fmt])
    got = dequantize(QuantizedTensor(torch.from_numpy(np.ascontiguousarray(raw)), fmt, w32.shape))
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, GGML_TYPE[fmt])))
    d = torch.from_numpy(raw.reshape(9, 5, -1)[..., :2].copy().view(np.float16).astype(np.float32))  # [9, 5, 1]
    err = (got.view(9, 5, 32) - torch.from_numpy(w32).view(9, 5, 32)).abs()
    step = 1.0 if fmt == "q5_0" else 0.5
    assert bool(
        (err <= d.abs() * step + 2e-3 * torch.from_numpy(w32).view(9, 5, 32).abs().amax(-1, keepdim=True)).all()
    )


@pytest.mark.parametrize("fmt", sorted(BLOCK_LAYOUTS))
def test_expert_stack_decodes_per_slice_as_gguf_decodes_the_3d_array(fmt):
    # an MoE expert tensor: numpy [E, N, bytes per row], per-row blocks, as gguf-py reads ffn_*_exps
    layout = BLOCK_LAYOUTS[fmt]
    experts, rows, cols = 3, 5, 2 * layout.block_size
    rng = np.random.default_rng(len(fmt))
    raw = rng.integers(0, 256, (experts, rows, cols // layout.block_size * layout.type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales include inf and NaN
        expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGML_TYPE[fmt]), dtype=np.float32))
    assert expected.shape == (experts, rows, cols)
    w = QuantizedTensor(torch.from_numpy(raw), fmt, (experts, rows, cols))
    assert_bitwise_equal_nan_aware(dequantize(w), expected)
    for e in range(experts):
        assert w[e].shape == (rows, cols) and w[e].data.data_ptr() == w.data[e].data_ptr()  # a view, not a copy
        assert_bitwise_equal_nan_aware(dequantize(w[e]), expected[e])
    assert_bitwise_equal_nan_aware(dequantize(w[-1]), expected[-1])


def test_expert_index_out_of_range_names_index_and_shape():
    w = QuantizedTensor(torch.zeros(2, 3, 34, dtype=torch.uint8), "q8_0", (2, 3, 32))
    with pytest.raises(IndexError, match=r"index 2 out of range .*\[2, 3, 32\]"):
        w[2]


def test_q8_0_hand_built_block():
    # block_q8_0 (ggml-common.h): | d: f16 little endian (2 bytes) | qs: 32 x int8 |
    # d = 0.5 = f16 0x3800 -> bytes 00 38; qs = -128, -127, ..., then 0..27 -> w = 0.5 * qs
    qs = np.array([-128, -1, 0, 1, 2, 127] + list(range(26)), dtype=np.int8)
    block = np.concatenate([np.array([0x00, 0x38], dtype=np.uint8), qs.view(np.uint8)])
    assert block.size == 34
    w = QuantizedTensor(torch.from_numpy(block.reshape(1, 34)), "q8_0", (1, 32))
    expected = torch.from_numpy(qs.astype(np.float32) * 0.5)[None]
    assert torch.equal(dequantize_q8_0(w), expected)


def test_q4_0_hand_built_block():
    # block_q4_0 (ggml-common.h): | d: f16 (2 bytes) | qs: 16 bytes |; byte j = (hi << 4) | lo
    # with lo = nibble of weight j and hi = nibble of weight j + 16; w = d * (nibble - 8).
    # d = 2.0 = f16 0x4000 -> bytes 00 40. Byte 0 = 0xF0: weight 0 = (0 - 8) * 2 = -16,
    # weight 16 = (15 - 8) * 2 = 14. Byte j (j >= 1) = (j << 4) | (15 - j).
    qs = np.array([0xF0] + [(j << 4) | (15 - j) for j in range(1, 16)], dtype=np.uint8)
    block = np.concatenate([np.array([0x00, 0x40], dtype=np.uint8), qs])
    w = QuantizedTensor(torch.from_numpy(block.reshape(1, 18)), "q4_0", (1, 32))
    low = [0] + [15 - j for j in range(1, 16)]
    high = [15] + list(range(1, 16))
    expected = torch.tensor([(n - 8) * 2.0 for n in low + high])[None]
    out = dequantize_q4_0(w)
    assert out[0, 0] == -16.0 and out[0, 16] == 14.0
    assert torch.equal(out, expected)


def test_q4_1_hand_built_block():
    # block_q4_1 (ggml-common.h): | d: f16 | m: f16 | qs: 16 bytes (nibbles as q4_0) |; w = d * q + m.
    # d = 0.5 = f16 0x3800 -> bytes 00 38; m = -1.0 = f16 0xBC00 -> bytes 00 BC.
    # Byte j = (j << 4) | (15 - j): weight j = 0.5 * (15 - j) - 1, weight j + 16 = 0.5 * j - 1.
    qs = np.array([(j << 4) | (15 - j) for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0x00, 0x38, 0x00, 0xBC], dtype=np.uint8), qs])
    assert block.size == BLOCK_LAYOUTS["q4_1"].type_size == 20
    out = dequantize_q4_1(QuantizedTensor(torch.from_numpy(block.reshape(1, 20)), "q4_1", (1, 32)))
    expected = torch.tensor([0.5 * (15 - j) - 1 for j in range(16)] + [0.5 * j - 1 for j in range(16)])[None]
    assert out[0, 0] == 6.5 and out[0, 16] == -1.0
    assert torch.equal(out, expected)


def test_q5_0_hand_built_block():
    # block_q5_0 (ggml-common.h): | d: f16 | qh: 4 bytes, uint32 little endian | qs: 16 bytes |;
    # q_i = nibble_i | (bit i of qh) << 4, nibbles as q4_0; w = d * (q - 16).
    # d = 0.25 = f16 0x3400 -> bytes 00 34; qh = 0x80000001 -> bytes 01 00 00 80 (weights 0 and 31).
    # Byte j = ((15 - j) << 4) | j: weight 0 = 0 | 16 -> 0; weight j (1..15) = j -> (j - 16) / 4;
    # weight 16 + j = 15 - j (| 16 for j = 15, weight 31 -> (0 + 16 - 16) / 4 = 0).
    qs = np.array([((15 - j) << 4) | j for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0x00, 0x34, 0x01, 0x00, 0x00, 0x80], dtype=np.uint8), qs])
    assert block.size == BLOCK_LAYOUTS["q5_0"].type_size == 22
    out = dequantize_q5_0(QuantizedTensor(torch.from_numpy(block.reshape(1, 22)), "q5_0", (1, 32)))
    q = [16] + list(range(1, 16)) + [15 - j for j in range(15)] + [16]
    expected = torch.tensor([(n - 16) * 0.25 for n in q])[None]
    assert out[0, 0] == 0.0 and out[0, 1] == -3.75 and out[0, 16] == -0.25 and out[0, 31] == 0.0
    assert torch.equal(out, expected)


def test_q5_1_hand_built_block():
    # block_q5_1 (ggml-common.h): | d: f16 | m: f16 | qh: 4 bytes | qs: 16 bytes |; w = d * q + m.
    # d = 1.0 = f16 0x3C00 -> bytes 00 3C; m = 0.5 = f16 0x3800 -> bytes 00 38;
    # qh = 0x0000FFFF -> bytes FF FF 00 00 (bit 4 set for weights 0..15 only).
    # Byte j = (j << 4) | j: weight j = j + 16 -> j + 16.5; weight 16 + j = j -> j + 0.5.
    qs = np.array([(j << 4) | j for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0x00, 0x3C, 0x00, 0x38, 0xFF, 0xFF, 0x00, 0x00], dtype=np.uint8), qs])
    assert block.size == BLOCK_LAYOUTS["q5_1"].type_size == 24
    out = dequantize_q5_1(QuantizedTensor(torch.from_numpy(block.reshape(1, 24)), "q5_1", (1, 32)))
    expected = torch.tensor([j + 16.5 for j in range(16)] + [j + 0.5 for j in range(16)])[None]
    assert torch.equal(out, expected)


def test_two_rows_keep_their_blocks_in_order():
    # two rows x two q8_0 blocks; scales 1, 2 / 3, 4 and qs all 1 -> each block is its scale
    scales = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float16)
    raw = np.zeros((2, 2, 34), dtype=np.uint8)
    raw[..., :2] = scales.reshape(2, 2, 1).view(np.uint8)
    raw[..., 2:] = 1
    w = QuantizedTensor(torch.from_numpy(raw.reshape(2, 68)), "q8_0", (2, 64))
    out = dequantize(w)
    assert torch.equal(out[:, ::32], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_unknown_format_names_valid_ones():
    w = QuantizedTensor(torch.zeros(1, 34, dtype=torch.uint8), "q8_0", (1, 32))
    object.__setattr__(w, "fmt", "iq4_xs")
    try:
        dequantize(w)
    except ValueError as e:
        assert "iq4_xs" in str(e) and "q8_0" in str(e)
    else:
        raise AssertionError("expected ValueError")
