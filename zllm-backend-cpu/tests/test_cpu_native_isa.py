"""The ISA levels of the native row kernels (``csrc/isa.h``): the GGUF block formats give the same
bits with the AVX2 and the AVX-512 kernels (GEMV and the MoE kernel, with SiLU-and-mul or the
clamped SwiGLU); the HF layouts stay within the reference's tolerance and batch-invariant at
each level (GEMV and the clamped-SwiGLU MoE); ``ZLLM_NATIVE_ISA`` parsing, forcing AVX2 in a
fresh process, and the registry note that ``zllm run --explain`` shows."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.kernels.registry import KernelRegistry
from zllm_backend_cpu import plugin
from zllm_backend_cpu.kernels.native import (
    ISA_LEVELS,
    ISA_SETTING,
    isa,
    isa_description,
    requested_isa,
    select_isa,
    unavailable_reason,
)

if unavailable_reason() is not None:  # the kernel modules bind the library's entry points at import
    pytest.skip(f"native library: {unavailable_reason()}", allow_module_level=True)

from test_cpu_gemv import make_weight  # noqa: E402
from test_cpu_quant_gemv import CASES, assert_close_to_reference, make_case, random_weight  # noqa: E402

from zllm.conformance.cases import make_expert_stack  # noqa: E402
from zllm.domain.moe_biased import moe_clamped_swiglu  # noqa: E402
from zllm.domain.quant import dequantize  # noqa: E402
from zllm.weights.formats import QuantizedTensor  # noqa: E402
from zllm_backend_cpu.kernels import gemv, quant_gemv  # noqa: E402
from zllm_backend_cpu.kernels.moe_gemv import moe_clamped_swiglu_gemv, moe_experts  # noqa: E402

T = TypeVar("T")
# the GGUF block formats with AVX-512 row kernels (csrc/gemv_avx512.c; the k-quants have none)
AVX512_BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@contextmanager
def at_level(level: str) -> Iterator[None]:
    """The row kernels of ``level`` inside the block, the level in use before it afterwards."""
    before = isa()
    assert select_isa(level) == level
    try:
        yield
    finally:
        select_isa(before)


def _cpu_has_avx512() -> bool:
    before = isa()
    has = select_isa("avx512") == "avx512"
    select_isa(before)
    return has


needs_avx512 = pytest.mark.skipif(not _cpu_has_avx512(),
                                  reason="this CPU lacks AVX-512 F/BW/VL/DQ/VNNI: only the AVX2 kernels run here")
LEVELS = [pytest.param("avx2"), pytest.param("avx512", marks=needs_avx512)]


def both(fn: Callable[[], T]) -> tuple[T, T]:
    """``fn()`` with the AVX2 kernels, then with the AVX-512 ones."""
    with at_level("avx2"):
        a = fn()
    with at_level("avx512"):
        b = fn()
    return a, b


@needs_avx512
@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(AVX512_BLOCK_FORMATS),
    t=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9]),  # AVX2: pairs and a last one; AVX-512: fours and the last 1-3
    n=st.sampled_from([1, 7, 40, 600]),  # 600 rows of K 320: more than one work item
    k_blocks=st.sampled_from([1, 2, 3, 10, 33]),  # odd counts end on an even block alone
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_block_formats_give_the_same_bits_with_avx2_and_avx512(fmt, t, n, k_blocks, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_blocks
    w = make_weight(fmt, n, k, g)
    x = torch.randn(t, k, generator=g) * torch.rand(t, k, generator=g) ** 4  # uneven magnitudes per block
    b = torch.randn(n, generator=g) if bias else None
    avx2, avx512 = both(lambda: gemv.gemv(x, w, b))
    assert torch.equal(avx2, avx512)


@needs_avx512
@pytest.mark.parametrize("formats", [("q8_0", "q4_0", "q5_0"), ("q4_1", "q5_1", "q8_0")])
def test_the_moe_kernel_gives_the_same_bits_with_avx2_and_avx512(formats):
    g = torch.Generator().manual_seed(3)
    experts, width, hidden, top_k, t = 6, 64, 96, 3, 13  # 39 pairs: experts with 1 to 4+ tokens
    gate = make_expert_stack(g, formats[0], experts, width, hidden)
    up = make_expert_stack(g, formats[1], experts, width, hidden)
    down = make_expert_stack(g, formats[2], experts, hidden, width)
    x = torch.randn(t, hidden, generator=g)
    ids = torch.randint(0, experts, (t, top_k), generator=g)
    weights = torch.rand(t, top_k, generator=g)
    avx2, avx512 = both(lambda: moe_experts(x, ids, weights, gate, up, down))
    assert avx2.abs().sum() > 0 and torch.equal(avx2, avx512)


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=15, deadline=None)
@given(case=st.sampled_from(CASES), t=st.integers(1, 3), n=st.integers(1, 24), k_units=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_hf_layouts_stay_within_the_reference_tolerance_at_each_level(level, case, t, n, k_units, seed):
    g = torch.Generator().manual_seed(seed)
    w = make_case(case, n, k_units, g)
    x = torch.randn(t, 32 * k_units, generator=g)
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert_close_to_reference(got, x, w, None)


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(["int4_g", "int4_sym", "mxfp4", "nvfp4"]), group=st.sampled_from([16, 32, 64, 128, 256]),
       t=st.sampled_from([1, 2, 3, 5]), n=st.sampled_from([1, 7, 40]), chunks=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_nibble_layouts_in_128_column_chunks_stay_within_the_reference_tolerance_at_each_level(
        level, fmt, group, t, n, chunks, seed):
    # K a multiple of 128: the chunk kernels (csrc/quant_gemv.c), x in lane order, scales per lane
    g = torch.Generator().manual_seed(seed)
    k = 128 * chunks
    w = random_weight(fmt[:4] + "_g" if fmt.startswith("int4") else fmt, n, k, g,
                      (1, group if k % group == 0 else 128), zero_point=fmt != "int4_sym")
    x = torch.randn(t, k, generator=g)
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert_close_to_reference(got, x, w, None)


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([16, 48, 128, None]), t=st.sampled_from([1, 2, 3, 5]), n=st.sampled_from([1, 7, 40]),
       k16=st.integers(1, 24), zero_point=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_rows_with_the_zero_points_taken_from_x_sums_stay_within_the_reference_tolerance_at_each_level(
        level, group, t, n, k16, zero_point, seed):
    # K a multiple of 16: AVX-512 sums unsigned q x and subtracts z times the group's x sum (csrc/quant_gemv.c);
    # group None: one scale per row (per channel), as compressed-tensors W8A16
    g = torch.Generator().manual_seed(seed)
    k = 16 * k16
    w = random_weight("int8_g", n, k, g, (1, group if group and k % group == 0 else k), zero_point=zero_point)
    x = torch.randn(t, k, generator=g) + 1.0  # a mean far from 0: z times the x sum is large
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert_close_to_reference(got, x, w, None)


@pytest.mark.parametrize("level", LEVELS)
def test_a_nan_nvfp4_scale_makes_its_row_nan_in_the_chunk_kernels_at_each_level(level):
    g = torch.Generator().manual_seed(5)
    w = random_weight("nvfp4", 3, 256, g)
    w.parts["scales"][1, 9] = 0x7F  # E4M3FN NaN, in the second 128 columns of row 1
    x = torch.randn(2, 256, generator=g)
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    assert got[:, 1].isnan().all() and got[:, [0, 2]].isfinite().all()


# Each weight is past the one-thread limit and cut into many work items: the chunk kernels (2100
# rows of 512 columns) and the INT8 rows in 64-column multiples (1500 x 640, groups of 128 or one).
THREAD_CASES = [(fmt, 2100, 512, 32, 11) for fmt in ("int4_g", "int8_g", "mxfp4", "nvfp4")] + [
    ("int8_g", 1500, 640, 128, 12),
    ("int8_g", 1500, 640, 640, 12),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("fmt", "n", "k", "group", "seed"), THREAD_CASES)
def test_the_row_kernels_give_the_same_bits_on_one_thread_and_two_at_each_level(level, fmt, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_weight(fmt, n, k, g, (1, group))
    x = torch.randn(3, k, generator=g)
    saved = torch.get_num_threads()
    with at_level(level):
        try:
            torch.set_num_threads(1)
            one = quant_gemv.quant_gemv(x, w, None)
            torch.set_num_threads(2)
            two = quant_gemv.quant_gemv(x, w, None)
        finally:
            torch.set_num_threads(saved)
    assert one.abs().sum() > 0 and torch.equal(one, two)
    assert_close_to_reference(two, x, w, None)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", ["fp8_channel", "fp8_ragged", "int4_g", "int8_g", "int8_sym", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("k_units", [5, 8])  # K 160: 16-column steps; K 256: 128-column chunks (nibbles)
def test_hf_layouts_give_each_row_the_same_bits_alone_or_in_a_batch_at_each_level(level, case, k_units):
    g = torch.Generator().manual_seed(7)
    w = make_case(case, 37, k_units, g)
    x = torch.randn(7, 32 * k_units, generator=g)
    with at_level(level):
        batch = quant_gemv.linear_quant_gemv_invariant(x, w, None)
        alone = torch.cat([quant_gemv.linear_quant_gemv_invariant(x[i:i + 1], w, None) for i in range(7)])
    assert torch.equal(batch, alone)


def identity_int8(k: int) -> QuantizedTensor:
    """The ``int8_g`` weight ``[K, K]`` with w = I (q one-hot, scale 1, no zero point): y = x, or the
    x an INT8 kernel computes with."""
    q = torch.eye(k, dtype=torch.uint8)
    return QuantizedTensor({"qweight": q, "scales": torch.ones(k, 1), "zeros": torch.zeros(k, 1, dtype=torch.uint8)},
                           "int8_g", (k, k), block=(1, k))


def identity_int4(k: int) -> QuantizedTensor:
    """The ``int4_g`` weight ``[K, K]`` with w = I (q one-hot, scale 1, zero point 0): y = x, or the
    x an INT4 kernel computes with."""
    q = torch.zeros(k, k // 2, dtype=torch.uint8)
    rows = torch.arange(k)
    q[rows, rows // 2] = torch.where(rows % 2 == 0, 1, 16).to(torch.uint8)  # low nibble: even column
    return QuantizedTensor({"qweight": q, "scales": torch.ones(k, 1), "zeros": torch.zeros(k, 1, dtype=torch.uint8)},
                           "int4_g", (k, k), block=(1, k))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("identity", [identity_int8, identity_int4], ids=["int8_g", "int4_g"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), k64=st.integers(1, 5))
def test_digit_rows_hold_x_to_2_to_the_minus_28_of_its_block_max_at_each_level(level, identity, data, k64):
    # INT8 at AVX-512 and INT4 at AVX2 (K >= 128, one group a row): x as four int8 digits below a
    # power of two per block of up to 256 columns (csrc/quant_digits.c), |x - held| < max|x| 2^-21 /
    # 127 with the block's max; held then rounded to f32 once. The other levels, INT4 at K 64 and a
    # token with a block max under 2^-99: x exactly. Any finite x: wide exponent ranges, zeros,
    # subnormals, outliers.
    k = 64 * k64
    x = torch.tensor(data.draw(st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=k, max_size=k)))[None]
    with at_level(level):
        got = quant_gemv.quant_gemv(x, identity(k), None)
    x64, err = x.double(), (got.double() - x.double()).abs()
    block_max = torch.cat([b.abs().amax().expand(b.shape[-1]) for b in x64[0].split(256)])
    bound = block_max * 2.0**-21 / 127 + (x64.abs() + block_max * 2.0**-28) * 2.0**-24
    assert (err <= bound).all(), (err - bound).max()


def assert_close_in_the_kernels_terms(got: torch.Tensor, x: torch.Tensor, w: QuantizedTensor):
    """Within 1e-6 of the f64 result relative to the INT8 kernels' terms, sum over groups of s (sum q |x|
    + z |sum x|) (s (sum q x - z sum x) at AVX-512: an outlier in x, or a large x sum against the zero
    points, can leave y itself far smaller)."""
    q, s, z = (w.parts[p].double() for p in ("qweight", "scales", "zeros"))
    (n, k), groups, t = w.shape, s.shape[1], x.shape[0]
    xg = x.double().view(t, groups, k // groups)
    qx = torch.einsum("tgc,ngc->tng", xg.abs(), q.view(n, groups, k // groups))
    terms = (s[None] * (qx + z[None] * xg.sum(-1).abs()[:, None, :])).sum(-1)
    ref = x.double() @ dequantize(w).double().t()
    assert ((got.double() - ref).abs() <= 1e-6 * terms).all()


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([64, 128, 192, None]), t=st.sampled_from([1, 2, 3, 5]), n=st.sampled_from([1, 7, 40]),
       k64=st.integers(1, 12), zero_point=st.booleans(), outliers=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_int8_rows_with_outliers_in_x_stay_within_the_reference_tolerance_at_each_level(
        level, group, t, n, k64, zero_point, outliers, seed):
    # K a multiple of 64: the VNNI kernel at AVX-512 (csrc/quant_gemv_vnni.c), per channel or in groups
    g = torch.Generator().manual_seed(seed)
    k = 64 * k64
    w = random_weight("int8_g", n, k, g, (1, group if group and k % group == 0 else k), zero_point=zero_point)
    x = torch.randn(t, k, generator=g) + 0.5
    for _ in range(outliers):  # one |x| 1000x the rest, in a random column of each token
        x[torch.arange(t), torch.randint(0, k, (t,), generator=g)] *= -1000.0
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
    if not outliers:  # with one, f32 rounding of q x ~ 1000 s q before z sum x cancels it can exceed 1e-5 of y
        assert_close_to_reference(got, x, w, None)
    assert_close_in_the_kernels_terms(got, x, w)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**-110])
def test_an_int8_token_the_vnni_digits_cannot_hold_takes_the_f32_kernel_alone_at_each_level(level, bad):
    # a non-finite x, or a block whose max |x| is under 2^-99 (the last digit's weight would be
    # subnormal): that token by quant_gemv.c's kernels, the others' bits as when alone
    g = torch.Generator().manual_seed(9)
    w = random_weight("int8_g", 24, 256, g, (1, 128))
    x = torch.randn(3, 256, generator=g)
    x[1] = x[1] * 2.0**-110 if bad == 2.0**-110 else x[1].index_fill(0, torch.tensor([77]), bad)
    with at_level(level):
        got = quant_gemv.quant_gemv(x, w, None)
        alone = torch.cat([quant_gemv.quant_gemv(x[i:i + 1], w, None) for i in (0, 2)])
    assert torch.equal(got[[0, 2]], alone)
    ref = x[1:2].double() @ dequantize(w).double().t()
    if bad == 2.0**-110:  # scaled back up: the f32 kernel's relative accuracy
        torch.testing.assert_close(got[1:2].double() * 2.0**110, ref * 2.0**110, atol=1e-5, rtol=1e-5)
    else:  # inf: the f32 kernels at AVX-512 give NaN (q inf - z inf), the reference +-inf
        assert not ref.isfinite().any() and not got[1:2].isfinite().any()




def test_the_setting_allows_avx512_unless_it_says_avx2():
    assert requested_isa({}) == requested_isa({ISA_SETTING: ""}) == requested_isa({ISA_SETTING: "auto"}) == "avx512"
    assert requested_isa({ISA_SETTING: " AVX2 "}) == "avx2"
    with pytest.raises(ValueError, match=r"ZLLM_NATIVE_ISA='sse4' is not one of auto, avx2"):
        requested_isa({ISA_SETTING: "sse4"})
    with pytest.raises(ValueError, match="ISA level 'avx1' is not one of avx2, avx512"):
        select_isa("avx1")


def test_the_row_kernels_registry_note_names_the_level_in_use():
    reg = KernelRegistry()
    plugin.zllm_register_kernels(reg)
    for op, fmt in (("linear", "q8_0"), ("linear", "mxfp4"), ("moe", "q4_0")):
        assert reg.lookup(op, "cpu", fmt).reason.endswith(isa_description())
    assert "native row kernels" not in reg.lookup("linear", "cpu", "f32").reason
    assert isa() in ISA_LEVELS


_FORCED = """
from zllm.kernels.registry import KernelRegistry
from zllm_backend_cpu import plugin
from zllm_backend_cpu.kernels.native import isa
reg = KernelRegistry()
plugin.zllm_register_kernels(reg)
print("NOTE", reg.lookup("linear", "cpu", "q4_0").reason, flush=True)
print("LEVEL", isa())
"""


def _forced(setting: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ISA_SETTING: setting}
    return subprocess.run([sys.executable, "-c", _FORCED], env=env, capture_output=True, text=True, timeout=120)


def test_the_setting_avx2_makes_a_fresh_process_run_and_name_the_avx2_kernels():
    proc = _forced("avx2")
    assert proc.returncode == 0, proc.stderr
    assert "LEVEL avx2" in proc.stdout and "native row kernels: AVX2 (ZLLM_NATIVE_ISA=avx2)" in proc.stdout


def test_an_invalid_setting_leaves_the_library_unavailable_saying_why():
    proc = _forced("bogus")
    reason = "native kernels unavailable: ZLLM_NATIVE_ISA='bogus' is not one of auto, avx2"
    assert reason in proc.stdout  # the torch kernels' registry note
    assert proc.returncode != 0 and reason in proc.stderr  # isa() raises with it


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("hidden", [128, 160])  # nibble rows in 128-column chunks, and not
def test_the_clamped_swiglu_moe_of_hf_layouts_stays_within_the_reference_tolerance_at_each_level(level, fmt, hidden):
    g = torch.Generator().manual_seed(6)
    experts, width, top_k, t = 5, 96, 2, 7
    gate, up = (make_expert_stack(g, fmt, experts, width, hidden) for _ in range(2))
    down = make_expert_stack(g, fmt, experts, hidden, width)
    biases = (torch.randn(experts, width, generator=g), torch.randn(experts, width, generator=g),
              torch.randn(experts, hidden, generator=g))
    x = torch.randn(t, hidden, generator=g) * 4
    ids = torch.randint(0, experts, (t, top_k), generator=g)
    weights = torch.rand(t, top_k, generator=g)
    with at_level(level):
        got = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, 1.702, 7.0)
        alone = moe_clamped_swiglu_gemv(x[3:4], ids[3:4], weights[3:4], gate, up, down, *biases, 1.702, 7.0)
    expected = moe_clamped_swiglu(x, ids, weights, gate, up, down, *biases, 1.702, 7.0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(alone[0], got[3])


@needs_avx512
def test_the_clamped_swiglu_moe_of_block_formats_gives_the_same_bits_with_avx2_and_avx512():
    g = torch.Generator().manual_seed(8)
    experts, width, hidden, top_k, t = 6, 64, 96, 3, 13
    gate = make_expert_stack(g, "q8_0", experts, width, hidden)
    up = make_expert_stack(g, "q4_0", experts, width, hidden)
    down = make_expert_stack(g, "q5_1", experts, hidden, width)
    biases = (torch.randn(experts, width, generator=g), torch.randn(experts, width, generator=g),
              torch.randn(experts, hidden, generator=g))
    x = torch.randn(t, hidden, generator=g) * 4
    ids = torch.randint(0, experts, (t, top_k), generator=g)
    weights = torch.rand(t, top_k, generator=g)
    avx2, avx512 = both(lambda: moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, 1.702, 7.0))
    assert avx2.abs().sum() > 0 and torch.equal(avx2, avx512)
