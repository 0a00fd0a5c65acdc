"""Reference dequantization vs the ``gguf`` package, bit for bit (NaN-aware), and vs hand-built blocks."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.quant import dequantize, dequantize_q4_0, dequantize_q8_0
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor

GGML_TYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
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
    """Random raw rows of ``fmt`` blocks; scales are random bits or forced special values."""
    layout = BLOCK_LAYOUTS[fmt]
    rows = draw(st.integers(1, 4))
    n_blocks = draw(st.integers(1, 4))
    size = rows * n_blocks * layout.type_size
    raw = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8)
    raw = raw.copy().reshape(rows, n_blocks, layout.type_size)
    scale_bits = draw(
        st.lists(st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL_F16_BITS)),
                 min_size=rows * n_blocks, max_size=rows * n_blocks)
    )
    raw[..., :2] = np.array(scale_bits, dtype="<u2").reshape(rows, n_blocks, 1).view(np.uint8)
    return raw.reshape(rows, n_blocks * layout.type_size), rows, n_blocks * layout.block_size


def _check_against_gguf(fmt: str, sample: tuple[np.ndarray, int, int]) -> None:
    raw, rows, cols = sample
    with np.errstate(invalid="ignore"):  # inf * 0 -> NaN is part of what is being compared
        expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGML_TYPE[fmt]), dtype=np.float32))
    expected = expected.reshape(rows, cols)
    w = QuantizedTensor(torch.from_numpy(raw.copy()), fmt, (rows, cols))
    assert_bitwise_equal_nan_aware(dequantize(w), expected)


@settings(max_examples=40, deadline=None)
@given(quantized_bytes("q8_0"))
def test_q8_0_matches_gguf_exactly(sample):
    _check_against_gguf("q8_0", sample)


@settings(max_examples=40, deadline=None)
@given(quantized_bytes("q4_0"))
def test_q4_0_matches_gguf_exactly(sample):
    _check_against_gguf("q4_0", sample)


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
