"""INT4 rows (``int4_g``) with K a multiple of 64: at the AVX2 level, with groups of at least 128
columns, the quants are multiplied by x split into four exact int8 digits
(``csrc/quant_gemv_int4.c``, ``csrc/quant_digits.c``: x held to 2^-28 of its block's max); groups
of 64 and the AVX-512 level multiply by f32 x (the lane kernels of ``csrc/quant_gemv.c``). All
against the f64 result of dequantize-then-matmul: groups of 64 / 128 / per channel, with and
without zero points, T 1-3, outliers in x, tiny and large x; tokens the digits cannot hold (inf,
NaN, a block's max under 2^-99) alone through the f32 kernels; the same bits for any T and thread
count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm_backend_cpu.kernels.native import unavailable_reason

if unavailable_reason() is not None:  # the kernel modules bind the library's entry points at import
    pytest.skip(f"native library: {unavailable_reason()}", allow_module_level=True)

from test_cpu_native_isa import LEVELS, at_level, identity_int4  # noqa: E402
from test_cpu_quant_gemv import assert_close_to_reference, random_weight  # noqa: E402

from zllm.domain.quant import dequantize  # noqa: E402
from zllm.weights.formats import QuantizedTensor  # noqa: E402
from zllm_backend_cpu.kernels import quant_gemv  # noqa: E402


def int4_weight(n: int, k: int, group: int | None, zero_point: bool, g: torch.Generator) -> QuantizedTensor:
    """A random ``int4_g`` weight ``[N, K]`` in groups of ``group`` (None, or a group not dividing K:
    one scale per row)."""
    return random_weight("int4_g", n, k, g, (1, group if group and k % group == 0 else k), zero_point=zero_point)


def assert_close_in_the_kernels_terms(got: torch.Tensor, x: torch.Tensor, w: QuantizedTensor):
    """Within 1e-6 of the f64 result relative to the INT4 kernels' terms, sum of s (q + z) |x| (they
    sum q x and subtract z times sums of x per 8 columns: an outlier in x, or a large x sum against
    the zero points, can leave y itself far smaller)."""
    s, z = w.parts["scales"].double(), w.parts["zeros"].double()
    (n, k), groups = w.shape, s.shape[1]
    packed = w.parts["qweight"]
    q = torch.stack([packed & 15, packed >> 4], dim=-1).view(n, k).double()  # low nibble: even column
    per_weight = ((q.view(n, groups, -1) + z[..., None]) * s[..., None]).view(n, k)
    terms = x.double().abs() @ per_weight.t()
    ref = x.double() @ dequantize(w).double().t()
    assert ((got.double() - ref).abs() <= 1e-6 * terms).all()


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=30, deadline=None)
@given(group=st.sampled_from([64, 128, None]), t=st.sampled_from([1, 2, 3]), n=st.sampled_from([1, 7, 40]),
       k64=st.integers(1, 12), zero_point=st.booleans(), shift=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**16))
def test_int4_rows_in_64_column_multiples_stay_within_the_reference_tolerance_at_each_level(
        level, group, t, n, k64, zero_point, shift, seed):
    # shift 1: a mean far from 0, so z times the x sums is large against y
    g = torch.Generator().manual_seed(seed)
    k = 64 * k64
    w = int4_weight(n, k, group, zero_point, g)
    x = torch.randn(t, k, generator=g) + shift
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert_close_to_reference(got, x, w, None)
    assert_close_in_the_kernels_terms(got, x, w)


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([64, 128, None]), t=st.sampled_from([1, 2, 3]), n=st.sampled_from([1, 7, 40]),
       k64=st.integers(1, 12), zero_point=st.booleans(), outliers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_int4_rows_with_outliers_in_x_stay_within_the_kernels_terms_at_each_level(
        level, group, t, n, k64, zero_point, outliers, seed):
    g = torch.Generator().manual_seed(seed)
    k = 64 * k64
    w = int4_weight(n, k, group, zero_point, g)
    x = torch.randn(t, k, generator=g) + 0.5
    for _ in range(outliers):  # one |x| 1000x the rest, in a random column of each token
        x[torch.arange(t), torch.randint(0, k, (t,), generator=g)] *= -1000.0
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert_close_in_the_kernels_terms(got, x, w)


def test_int4_rows_at_avx2_multiply_by_the_digits_of_x():
    # 1 + 2^-23 next to 100 in a block: the last digit's weight is 2^-21, so the digits hold 1
    x = torch.zeros(1, 128)
    x[0, 3], x[0, 100] = 1.0 + 2.0**-23, 100.0
    with at_level("avx2"):
        got = quant_gemv.quant_gemv(x, identity_int4(128), None)
    assert got[0, 3] == 1.0 and got[0, 100] == 100.0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scale", [2.0**-90, 2.0**40])
def test_int4_rows_keep_their_relative_accuracy_for_tiny_and_large_x_at_each_level(level, scale):
    g = torch.Generator().manual_seed(13)
    w = int4_weight(24, 512, 128, True, g)
    x = torch.randn(2, 512, generator=g)
    with at_level(level):
        got = quant_gemv.quant_gemv(x * scale, w, None)
    # scaled back: the same reference tolerance as x itself
    assert_close_to_reference(got / scale, x, w, None)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**-110])
def test_an_int4_token_the_digits_cannot_hold_takes_the_f32_kernel_alone_at_each_level(level, bad):
    # a non-finite x, or a block whose max |x| is under 2^-99 (the last digit's weight would be
    # subnormal): that token by quant_gemv.c's f32 kernels, the others' bits as when alone
    g = torch.Generator().manual_seed(9)
    w = int4_weight(24, 256, 128, True, g)
    x = torch.randn(3, 256, generator=g)
    x[1] = x[1] * 2.0**-110 if bad == 2.0**-110 else x[1].index_fill(0, torch.tensor([77]), bad)
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
        alone = torch.cat([quant_gemv.quant_gemv(x[i:i + 1], w, None) for i in (0, 2)])
        bad_alone = quant_gemv.quant_gemv(x[1:2], w, None)
    assert torch.equal(got[[0, 2]], alone)
    torch.testing.assert_close(got[1:2], bad_alone, atol=0, rtol=0, equal_nan=True)
    ref = x[1:2].double() @ dequantize(w).double().t()
    if bad == 2.0**-110:  # scaled back up: the f32 kernel's relative accuracy
        torch.testing.assert_close(got[1:2].double() * 2.0**110, ref * 2.0**110, atol=1e-5, rtol=1e-5)
    else:  # the f32 kernels give NaN or +-inf (q inf - z inf), the reference +-inf or NaN
        assert not ref.isfinite().any() and not got[1:2].isfinite().any()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("group", [64, 128, None])
def test_int4_rows_give_the_same_bits_for_any_token_count_and_thread_count_at_each_level(level, group):
    g = torch.Generator().manual_seed(12)
    w = int4_weight(2100, 640, group, True, g)  # 2100 x 320 bytes: past the one-thread limit, many items
    x = torch.randn(3, 640, generator=g)
    saved = torch.get_num_threads()
    with at_level(level):
        try:
            torch.set_num_threads(1)
            one = quant_gemv.quant_gemv(x, w, None)
            alone = torch.cat([quant_gemv.quant_gemv(x[i:i + 1], w, None) for i in range(3)])
            pairs = torch.cat([quant_gemv.quant_gemv(x[:2], w, None), quant_gemv.quant_gemv(x[2:], w, None)])
            torch.set_num_threads(2)
            two = quant_gemv.quant_gemv(x, w, None)
        finally:
            torch.set_num_threads(saved)
    assert one.abs().sum() > 0 and torch.equal(one, two) and torch.equal(one, alone) and torch.equal(one, pairs)
    assert_close_to_reference(two, x, w, None)
