"""The FP8 rows through AVX-512 BF16 dot products (``csrc/quant_gemv_bf16.c``): every E4M3 byte
decodes to its exact bf16, the three-piece split of the activations is exact and in the range
``vdpbf16ps`` computes exactly, the GEMV matches the reference for block, channel and tensor
scales and odd shapes, a row's bits do not depend on the other tokens (also where a token's x
falls back to the f32 rows), and the kernels run only at the AVX-512 level."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm_backend_cpu.kernels.native import ISA_SETTING, isa, library, select_fp8_bf16, select_isa, unavailable_reason

if unavailable_reason() is not None:
    pytest.skip(f"native library: {unavailable_reason()}", allow_module_level=True)

from test_cpu_quant_gemv import assert_close_to_reference, random_weight  # noqa: E402

from zllm.weights.formats import QuantizedTensor  # noqa: E402
from zllm_backend_cpu.kernels.quant_gemv import quant_gemv  # noqa: E402


def _has_bf16_rows() -> bool:
    before = isa()
    has = select_isa("avx512") == "avx512" and select_fp8_bf16(True)
    select_isa(before)
    return has


pytestmark = pytest.mark.skipif(not _has_bf16_rows(), reason="this CPU lacks AVX-512 BF16 / VBMI: the f32 rows run")


@contextmanager
def bf16_rows(on: bool) -> Iterator[None]:
    """The AVX-512 level with the BF16 rows on or off inside the block; the BF16 rows allowed and
    the level in use before it afterwards."""
    before = isa()
    select_isa("avx512")
    assert select_fp8_bf16(on) == on
    try:
        yield
    finally:
        select_fp8_bf16(True)
        select_isa(before)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows' pieces of x [T, K] f32: (pieces [T, 3, K] as f32 (hi, mid, lo), s [T]) or None
    where some token is out of their range."""
    fn = library().zllm_fp8_bf16_split
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    x = x.contiguous()
    t, k = x.shape
    pieces = torch.zeros(t, 3, k, dtype=torch.int16)
    s = torch.zeros(t, dtype=torch.int32)
    if not fn(x.data_ptr(), t, k, pieces.data_ptr(), s.data_ptr()):
        return None
    return pieces.view(torch.bfloat16).float(), s


def fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> QuantizedTensor:
    return QuantizedTensor({"qweight": q, "scale": scale}, "fp8_e4m3", tuple(q.shape), block=block)


def test_every_e4m3_byte_decodes_to_the_bf16_of_its_value():
    fn = library().zllm_fp8_bf16_decode_table
    fn.argtypes, fn.restype = [ctypes.c_void_p], None
    table = torch.zeros(256, dtype=torch.int16)
    fn(table.data_ptr())
    got = table.view(torch.bfloat16).float()
    expected = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    nan = expected.isnan()
    assert nan.sum() == 2 and got[nan].isnan().all()
    assert torch.equal(got[~nan], expected[~nan])
    # vdpbf16ps reads bf16 subnormals as zero: every nonzero weight must be a normal bf16
    exponent_bits = table.to(torch.int32) & 0x7F80
    assert ((exponent_bits > 0) | (expected == 0)).all()


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite32, min_size=1, max_size=150), scale_exp=st.integers(-60, 60))
def test_the_three_pieces_sum_exactly_to_the_scaled_activations(values, scale_exp):
    x = torch.tensor([values], dtype=torch.float32)
    x = x * 2.0**scale_exp if x.abs().max() < 2.0**60 else x
    nonzero = x[x != 0].abs()
    in_range = nonzero.numel() == 0 or (
        math.frexp(nonzero.min().item())[1] >= math.frexp(nonzero.max().item())[1] - 93
        and nonzero.min().item() >= 2.0**-126)
    out = split(x)
    assert (out is not None) == in_range
    if out is None:
        return
    pieces, s = out
    scaled = x.double() * 2.0 ** s[0].item()
    assert torch.equal(pieces.double().sum(1), scaled)  # hi + mid + lo == x 2^s, exactly
    assert scaled.abs().max() < 1
    # every piece a multiple of 2^-117: its products with E4M3 (multiples of 2^-9) are multiples
    # of 2^-126, so normal (or zero) and exact in f32, as every partial sum
    units = pieces.double() * 2.0**117
    assert torch.equal(units, units.floor())


def test_activations_out_of_range_are_refused_by_the_split():
    x = torch.ones(1, 70)
    assert split(x) is not None
    for bad in (math.nan, math.inf, -math.inf, 1e-40, 2.0**-95):  # subnormal; 95 binades below the max
        y = x.clone()
        y[0, 33] = bad
        assert split(y) is None, bad
    y = x.clone()
    y[0, 33] = 2.0**-93  # within range
    assert split(y) is not None


CASES = [  # (N, K, (bn, bk)): DeepSeek-V3 blocks, ragged edges, per channel, per tensor, K past 64-multiples
    (40, 256, (128, 128)), (37, 300, (128, 128)), (130, 200, (128, 128)), (9, 64, (4, 64)), (11, 448, (3, 192)),
    (13, 100, (1, 100)), (17, 1000, (1, 1000)), (5, 36, (5, 36)), (21, 130, (21, 130)), (7, 1, (1, 1)),
]


@pytest.mark.parametrize(("n", "k", "block"), CASES)
@pytest.mark.parametrize("t", [1, 2, 3, 5])
def test_gemv_matches_the_reference_for_block_channel_and_tensor_scales(n, k, block, t):
    g = torch.Generator().manual_seed(n * 1000 + k + t)
    w = random_weight("fp8_e4m3", n, k, g, block)
    x = torch.randn(t, k, generator=g) * torch.rand(t, k, generator=g) ** 4  # uneven magnitudes
    b = torch.randn(n, generator=g)
    with bf16_rows(True):
        got = quant_gemv(x, w, b)
    assert_close_to_reference(got, x, w, b)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 400), bk_units=st.integers(1, 3), bn=st.integers(1, 9),
       t=st.integers(1, 4), log_scale=st.integers(-40, 40), seed=st.integers(0, 2**16))
def test_gemv_matches_the_reference_at_any_shape_and_activation_scale(n, k, bk_units, bn, t, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_weight("fp8_e4m3", n, k, g, (bn, 64 * bk_units))
    x = torch.randn(t, k, generator=g)
    with bf16_rows(True):
        got = quant_gemv(x * 2.0**log_scale, w, None)
    assert_close_to_reference(got * 2.0**-log_scale, x, w, None)


def test_subnormal_e4m3_weights_count():
    # all 14 nonzero subnormal bytes (|w| = m 2^-9): bf16 subnormals would be read as zero
    q = torch.tensor([[m | sign for m in range(1, 8) for sign in (0, 0x80)] * 5], dtype=torch.uint8)  # [1, 70]
    w = fp8_weight(q, torch.full((1, 1), 3.0), (1, 70))
    x = torch.arange(1, 71, dtype=torch.float32)[None]
    with bf16_rows(True):
        got = quant_gemv(x, w, None)
    expected = (x.double() * q.view(torch.float8_e4m3fn).double() * 3.0).sum()
    assert expected != 0 and got.item() == expected.item()  # small integers times 2^-9: exact


def test_nan_bytes_give_nan_as_the_reference():
    q = torch.full((2, 64), 0x38, dtype=torch.uint8)
    q[1, 5] = 0xFF
    with bf16_rows(True):
        got = quant_gemv(torch.ones(1, 64), fp8_weight(q, torch.ones(1, 1), (2, 64)), None)
    assert got[0, 0] == 64.0 and got[0, 1].isnan()


def test_a_row_gets_the_same_bits_whatever_the_other_tokens_and_rows():
    g = torch.Generator().manual_seed(5)
    w = random_weight("fp8_e4m3", 67, 384, g, (128, 128))  # 67 rows: triples, pairs and single rows
    x = torch.randn(7, 384, generator=g)
    x[4, 10] = math.inf  # out of range: this token takes the f32 rows
    x[2, 11] = 1e-35  # more than 94 binades below the row's max: the f32 rows too
    with bf16_rows(True):
        alone = torch.cat([quant_gemv(x[i:i + 1], w, None) for i in range(7)])
        together = quant_gemv(x, w, None)
        pairs_then_one = torch.cat([quant_gemv(x[:4], w, None), quant_gemv(x[4:], w, None)])
    assert torch.equal(together, alone) and torch.equal(pairs_then_one, alone)
    sub = QuantizedTensor({"qweight": w.parts["qweight"][5:9], "scale": w.parts["scale"][:1]}, "fp8_e4m3", (4, 384),
                          block=(128, 128))  # rows 5-8 alone: all in the first row block
    with bf16_rows(True):
        assert torch.equal(quant_gemv(x, sub, None), alone[:, 5:9])
    with bf16_rows(False):
        f32 = quant_gemv(x, w, None)
    assert torch.equal(together[[2, 4]], f32[[2, 4]])  # the fallen-back tokens: the f32 rows' bits
    assert not torch.equal(together[[0, 1, 3]], f32[[0, 1, 3]])  # the others: the BF16 rows


def test_the_bf16_rows_run_only_at_the_avx512_level():
    before = isa()
    try:
        select_isa("avx2")
        assert not select_fp8_bf16(True)
        select_isa("avx512")
        assert select_fp8_bf16(True)
    finally:
        select_isa(before)


def test_the_setting_avx2_turns_the_bf16_rows_off_in_a_fresh_process():
    code = "from zllm_backend_cpu.kernels.native import select_fp8_bf16; print('BF16', select_fp8_bf16(True))"
    for setting, expected in (("avx2", "BF16 False"), ("auto", "BF16 True")):
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, ISA_SETTING: setting},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout
