"""The weight-format registry and the f32 reference decodes of its HF formats on hand-built
bytes (bit layouts commented), plus round trips through zllm's tiny quantizers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance import quantizers
from zllm.domain.quant import dequantize
from zllm.weights.formats import ALL_FORMATS, BLOCK_LAYOUTS, FORMATS, QuantizedTensor


def test_every_format_declares_parts_a_reference_and_compat_columns():
    assert ALL_FORMATS == ("f32", "f16", "bf16", *FORMATS)
    assert set(BLOCK_LAYOUTS) == {name for name, f in FORMATS.items() if f.gguf is not None}
    columns = [c for f in FORMATS.values() for c in f.columns]
    assert len(columns) == len(set(columns))
    for name, fmt in FORMATS.items():
        module, _, fn = fmt.reference.partition(":")
        assert callable(getattr(__import__(module, fromlist=[fn]), fn)), name
        shapes = fmt.part_shapes((), 64, 128, fmt.fixed_block or (1, 32))
        assert set(shapes) == {p.name for p in fmt.parts}, name


@pytest.mark.parametrize(("fmt", "block", "bits"), [
    ("q8_0", None, 8.5), ("q4_0", None, 4.5), ("mxfp4", None, 4.25), ("nvfp4", None, 4.5),
    ("fp8_e4m3", (128, 128), 8 + 32 / 128**2), ("int4_g", (1, 128), 4 + 40 / 128), ("int8_g", (1, 64), 8 + 40 / 64),
])
def test_bits_per_weight_count_every_part(fmt, block, bits):
    # nvfp4's one f32 global scale is negligible over 1024 x 1024 weights
    assert FORMATS[fmt].bits_per_weight((1024, 1024), block) == pytest.approx(bits, abs=1e-4)


def test_fp8_e4m3_bytes_times_block_scales_with_partial_blocks():
    # E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits. 0x38 = 1.0, 0xC0 = -2.0,
    # 0x7E = 448 (largest finite), 0x01 = 2^-9 (smallest subnormal), 0x7F = NaN.
    q = torch.tensor([[0x38, 0xC0, 0x7E], [0x01, 0x00, 0x7F], [0x38, 0x38, 0x38]], dtype=torch.uint8)
    scale = torch.tensor([[2.0, 0.5], [4.0, 8.0]])  # blocks (2, 2): rows {0, 1} | {2}, cols {0, 1} | {2}
    w = dequantize(QuantizedTensor({"qweight": q, "scale": scale}, "fp8_e4m3", (3, 3), block=(2, 2)))
    assert w[0].tolist() == [2.0, -4.0, 224.0] and w[1, 0] == 2.0**-8 and w[1, 1] == 0.0
    assert math.isnan(w[1, 2]) and w[2].tolist() == [4.0, 4.0, 8.0]


def test_int4_nibbles_low_first_minus_zero_times_scale_and_perm_undone():
    # byte 0x21: column 0 = 1 (low nibble), column 1 = 2 (high nibble); byte 0xF0: 0 then 15.
    parts = {"qweight": torch.tensor([[0x21, 0xF0]], dtype=torch.uint8), "scales": torch.tensor([[0.5, 2.0]]),
             "zeros": torch.tensor([[1, 8]], dtype=torch.uint8)}
    w = QuantizedTensor(parts, "int4_g", (1, 4), block=(1, 2))
    assert dequantize(w).tolist() == [[0.0, 0.5, -16.0, 14.0]]
    permuted = QuantizedTensor({**parts, "perm": torch.tensor([2, 0, 3, 1])}, "int4_g", (1, 4), block=(1, 2))
    assert dequantize(permuted).tolist() == [[0.5, 14.0, 0.0, -16.0]]  # stored column j -> logical perm[j]


def test_mxfp4_and_nvfp4_e2m1_codes_times_their_scales():
    # byte 0x9F: low nibble 0xF = -6 (sign bit 3, code 7), high nibble 0x9 = -0.5; 0x72: 1.0, 6.0.
    qweight = torch.tensor([[0x9F, 0x72] * 16], dtype=torch.uint8)  # [1, 32]: K = 64
    exponents = torch.tensor([[128, 126]], dtype=torch.uint8)
    mx = QuantizedTensor({"qweight": qweight, "scales": exponents}, "mxfp4", (1, 64))
    w = dequantize(mx)  # E8M0 128 = 2, 126 = 0.5
    assert w[0, :4].tolist() == [-12.0, -1.0, 2.0, 12.0] and w[0, 32:36].tolist() == [-3.0, -0.25, 0.5, 3.0]
    scales = torch.tensor([[0x38, 0x40, 0x30, 0x48]], dtype=torch.uint8)  # E4M3: 1, 2, 0.5, 4
    nv = QuantizedTensor({"qweight": qweight, "scales": scales, "global_scale": torch.tensor(0.5)}, "nvfp4", (1, 64))
    w = dequantize(nv)
    assert w[0, :4].tolist() == [-3.0, -0.25, 0.5, 3.0] and w[0, 48:52].tolist() == [-12.0, -1.0, 2.0, 12.0]


def test_expert_stacks_decode_slice_by_slice():
    g = torch.Generator().manual_seed(0)
    experts = [quantizers.quantize_nvfp4(torch.randn(8, 32, generator=g)) for _ in range(3)]
    stack = QuantizedTensor({n: torch.stack([e.parts[n] for e in experts]) for n in experts[0].parts}, "nvfp4",
                            (3, 8, 32))
    full = dequantize(stack)
    for i, e in enumerate(experts):
        assert torch.equal(full[i], dequantize(e)) and torch.equal(dequantize(stack[i]), dequantize(e))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 4), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(["fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4"]))
def test_quantizers_round_trip_within_half_a_step(n, groups, seed, fmt):
    w = torch.randn(n, 32 * groups, generator=torch.Generator().manual_seed(seed))
    q = quantizers.quantize(w, fmt)
    err = (dequantize(q) - w).abs()
    amax = w.abs().amax()
    bound = {  # per element, from each format's grid spacing near the largest value
        "fp8_e4m3": amax * 2.0**-4,  # 3 mantissa bits: half a step is 2^-4 relative
        "int4_g": (w.amax() - w.amin()) / 15,  # a step of the widest group (rounding + clamped zero)
        "int8_g": (w.amax() - w.amin()) / 255,
        "mxfp4": amax / 3,  # E2M1 steps of 2 between 4 and 6, scaled by 2^e <= amax / 4
        "nvfp4": amax / 5,  # the same, plus the E4M3 rounding of the block scale
    }[fmt]
    assert float(err.max()) <= float(bound) + 1e-6
    assert tuple(q.shape) == tuple(w.shape) and q.nbytes < w.numel() * 4


def test_rows_of_a_block_scaled_weight_keep_their_scales():
    w = quantizers.quantize_fp8_e4m3(torch.randn(40, 70, generator=torch.Generator().manual_seed(1)), (16, 32))
    ids = torch.tensor([39, 0, 17, 16])
    picked = w.rows(ids)
    assert picked.block == (1, 32) and torch.equal(dequantize(picked), dequantize(w)[ids])
    assert torch.equal(dequantize(w.rows(slice(5, 33))), dequantize(w)[5:33])
