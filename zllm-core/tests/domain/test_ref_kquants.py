"""Reference k-quant dequantization (q2_k … q6_k) vs the ``gguf`` package, bit for bit (NaN-aware),
and vs blocks packed here from chosen integers, following ggml's ``quantize_row_q*_K_ref``."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.quant import dequantize
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor

KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
QK_K = 256
# Byte offsets of the f16 super-block scales in each block (ggml-common.h): d, then dmin.
F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# +inf, -inf, qNaN, sNaN payload, min subnormal, -0, 1.0, f16 max
SPECIAL_F16_BITS = [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0001, 0x8000, 0x3C00, 0x7BFF]
finite_f16 = st.floats(width=16, allow_nan=False, allow_infinity=False)


def assert_bitwise_equal_nan_aware(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    # every non-NaN value identical down to the bit (-0.0 vs 0.0 would fail too)
    assert torch.equal(actual[~nan_a].view(torch.int32), expected[~nan_e].view(torch.int32))


def gguf_reference(raw: np.ndarray, fmt: str, rows: int, cols: int) -> torch.Tensor:
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 -> NaN is part of what is compared
        out = gguf_dequantize(raw, gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(rows, cols)


@st.composite
def kquant_rows(draw, fmt: str, scale_bits) -> tuple[np.ndarray, int, int]:
    """Random bytes for ``rows x n_blocks`` super-blocks; their f16 ``d``/``dmin`` drawn from ``scale_bits``."""
    layout = BLOCK_LAYOUTS[fmt]
    rows, n_blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n = rows * n_blocks * layout.type_size
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=np.uint8).copy()
    raw = raw.reshape(rows, n_blocks, layout.type_size)
    for offset in F16_FIELDS[fmt]:
        bits = draw(st.lists(scale_bits, min_size=rows * n_blocks, max_size=rows * n_blocks))
        raw[..., offset : offset + 2] = np.array(bits, dtype="<u2").reshape(rows, n_blocks, 1).view(np.uint8)
    return raw.reshape(rows, -1), rows, n_blocks * QK_K


FINITE_BITS = finite_f16.map(lambda v: int(np.array(v, dtype="<f2").view("<u2")))
ANY_BITS = st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL_F16_BITS))


@pytest.mark.parametrize("fmt", KQUANTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_gguf_exactly_with_finite_scales(fmt, data):
    raw, rows, cols = data.draw(kquant_rows(fmt, FINITE_BITS))
    got = dequantize(QuantizedTensor(torch.from_numpy(raw.copy()), fmt, (rows, cols)))
    assert bool(got.isfinite().all())  # finite f16 scales x 6-bit ints stay far from f32 overflow
    assert_bitwise_equal_nan_aware(got, gguf_reference(raw, fmt, rows, cols))


@pytest.mark.parametrize("fmt", KQUANTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_gguf_exactly_with_any_scale_bits(fmt, data):
    raw, rows, cols = data.draw(kquant_rows(fmt, ANY_BITS))
    got = dequantize(QuantizedTensor(torch.from_numpy(raw.copy()), fmt, (rows, cols)))
    assert_bitwise_equal_nan_aware(got, gguf_reference(raw, fmt, rows, cols))


# --- blocks packed from chosen integers ------------------------------------------------------
# Each packer writes ONE super-block from the quantized integers ``q`` (256 values), the
# sub-block integer scales/mins and the f16 d/dmin, following the packing loops of ggml's
# quantize_row_q*_K_ref (ggml-quants.c). The expected weights are the layout's formula, in
# gguf-py's f32 order: (d * sc) * q - (dmin * m).


def _f16_bytes(v: float) -> np.ndarray:
    return np.array([v], dtype="<f2").view(np.uint8)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """64 bytes: for each 128-weight half h and l < 32, byte 32h + l holds L[128h + 32j + l] at bits 2j."""
    out = np.zeros(64, dtype=np.uint8)
    for h in range(2):
        for j in range(4):
            out[32 * h : 32 * h + 32] |= (L[128 * h + 32 * j : 128 * h + 32 * j + 32] << (2 * j)).astype(np.uint8)
    return out


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """12 bytes for 8 6-bit scales and mins (ggml quantize_row_q4_K_ref)."""
    out = np.zeros(12, dtype=np.uint8)
    for j in range(8):
        if j < 4:
            out[j], out[j + 4] = sc[j], m[j]
        else:
            out[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4)
            out[j - 4] |= (sc[j] >> 4) << 6
            out[j] |= (m[j] >> 4) << 6
    return out


def pack_q2_k(q, sc, m, d, dmin):
    # | scales[16]: sc | m << 4 | qs[64]: 2-bit q | d f16 | dmin f16 |   (84 bytes)
    return np.concatenate([(sc | (m << 4)).astype(np.uint8), _pack_2bit(q), _f16_bytes(d), _f16_bytes(dmin)])


def pack_q3_k(q, sc, d):
    # | hmask[32] | qs[64]: low 2 bits of q + 4 | scales[12]: 6-bit sc + 32 | d f16 |   (110 bytes)
    L = q + 4  # [0, 7]
    hmask = np.zeros(32, dtype=np.uint8)
    for i in range(QK_K):  # bit i // 32 of hmask[i % 32] = bit 2 of L
        hmask[i % 32] |= (L[i] >> 2) << (i // 32)
    ls = sc + 32  # [0, 63]
    scales = np.zeros(12, dtype=np.uint8)
    for j in range(16):
        scales[j % 8] |= (ls[j] & 0xF) << (4 * (j // 8))
        scales[8 + j % 4] |= (ls[j] >> 4) << (2 * (j // 4))
    return np.concatenate([hmask, _pack_2bit(L & 3), scales, _f16_bytes(d)])


def pack_q4_k(q, sc, m, d, dmin):
    # | d f16 | dmin f16 | scales[12] | qs[128]: byte 32g + l = q[64g + l] | q[64g + 32 + l] << 4 |   (144)
    qs = np.concatenate([q[64 * g : 64 * g + 32] | (q[64 * g + 32 : 64 * g + 64] << 4) for g in range(4)])
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(sc, m), qs.astype(np.uint8)])


def pack_q5_k(q, sc, m, d, dmin):
    # | d | dmin | scales[12] | qh[32]: bit i // 32 of qh[i % 32] = bit 4 of q[i] | qs[128] as q4_k |   (176)
    qh = np.zeros(32, dtype=np.uint8)
    for i in range(QK_K):
        qh[i % 32] |= (q[i] >> 4) << (i // 32)
    low = q & 0xF
    qs = np.concatenate([low[64 * g : 64 * g + 32] | (low[64 * g + 32 : 64 * g + 64] << 4) for g in range(4)])
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min_k4(sc, m), qh, qs.astype(np.uint8)])


def pack_q6_k(q, sc, d):
    # | ql[128] | qh[64] | int8 scales[16] | d f16 |   (210 bytes); L = q + 32 in [0, 63]
    L = q + 32
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for h in range(2):  # ggml quantize_row_q6_K_ref, per 128-weight half
        for i in range(32):
            a, b, c, e = (L[128 * h + i + 32 * j] for j in range(4))
            ql[64 * h + i] = (a & 0xF) | ((c & 0xF) << 4)
            ql[64 * h + i + 32] = (b & 0xF) | ((e & 0xF) << 4)
            qh[32 * h + i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)])


# fmt -> (q range, sub-block size, scale range, min range or None, packer)
PACKING = {
    "q2_k": ((0, 3), 16, (0, 15), (0, 15), pack_q2_k),
    "q3_k": ((-4, 3), 16, (-32, 31), None, pack_q3_k),
    "q4_k": ((0, 15), 32, (0, 63), (0, 63), pack_q4_k),
    "q5_k": ((0, 31), 32, (0, 63), (0, 63), pack_q5_k),
    "q6_k": ((-32, 31), 16, (-128, 127), None, pack_q6_k),
}


@pytest.mark.parametrize("fmt", KQUANTS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), d=finite_f16, dmin=finite_f16)
def test_packed_block_decodes_to_its_formula(fmt, seed, d, dmin):
    (q_lo, q_hi), sub, (s_lo, s_hi), mins, pack = PACKING[fmt]
    rng = np.random.default_rng(seed)
    q = rng.integers(q_lo, q_hi + 1, QK_K).astype(np.int64)
    sc = rng.integers(s_lo, s_hi + 1, QK_K // sub).astype(np.int64)
    d32, dmin32 = np.float32(np.float16(d)), np.float32(np.float16(dmin))
    if mins is None:
        block = pack(q, sc, d)
        expected = np.repeat(d32 * sc.astype(np.float32), sub) * q.astype(np.float32)
    else:
        m = rng.integers(mins[0], mins[1] + 1, QK_K // sub).astype(np.int64)
        block = pack(q, sc, m, d, dmin)
        expected = (np.repeat(d32 * sc.astype(np.float32), sub) * q.astype(np.float32)
                    - np.repeat(dmin32 * m.astype(np.float32), sub))
    assert block.size == BLOCK_LAYOUTS[fmt].type_size
    got = dequantize(QuantizedTensor(torch.from_numpy(block.reshape(1, -1)), fmt, (1, QK_K)))
    assert_bitwise_equal_nan_aware(got, torch.from_numpy(expected.astype(np.float32)).reshape(1, QK_K))


def test_q4_k_hand_built_block():
    # block_q4_K: | d = 1.0 (00 3C) | dmin = 0.5 (00 38) | scales[12] | qs[128] = 0x21 everywhere |
    # scales bytes: 0-3 = scale[0..3] | high bits of scale[4..7] << 6; 4-7 = min[0..3] | high
    # bits of min[4..7] << 6; 8-11 = low nibble of scale[4..7] | low nibble of min[4..7] << 4.
    # scale = 1, 2, 3, 4, 17, 33, 49, 63; min = 0, 1, 2, 3, 16, 32, 48, 62
    scales = [1 | 1 << 6, 2 | 2 << 6, 3 | 3 << 6, 4 | 3 << 6,  # scale 17 = 0b01_0001, 33 = 0b10_0001 …
              0 | 1 << 6, 1 | 2 << 6, 2 | 3 << 6, 3 | 3 << 6,  # min 16 = 0b01_0000, 32, 48, 62 = 0b11_1110
              1 | 0 << 4, 1 | 0 << 4, 1 | 0 << 4, 15 | 14 << 4]  # fmt: skip
    block = np.array([0x00, 0x3C, 0x00, 0x38, *scales] + [0x21] * 128, dtype=np.uint8)
    # qs byte 0x21: low nibble 1 -> sub-blocks 0, 2, 4, 6 have q = 1; high nibble 2 -> 1, 3, 5, 7 have q = 2
    sc, mn, q = [1, 2, 3, 4, 17, 33, 49, 63], [0, 1, 2, 3, 16, 32, 48, 62], [1, 2, 1, 2, 1, 2, 1, 2]
    expected = torch.tensor([1.0 * s * qq - 0.5 * m for s, m, qq in zip(sc, mn, q, strict=True)])
    expected = expected.repeat_interleave(32)[None]
    got = dequantize(QuantizedTensor(torch.from_numpy(block.reshape(1, 144)), "q4_k", (1, 256)))
    assert got[0, 0] == 1.0 and got[0, 255] == 63 * 2 - 31.0
    assert torch.equal(got, expected)
    assert torch.equal(got, gguf_reference(block.reshape(1, 144), "q4_k", 1, 256))
