"""Native GEMV kernels (``csrc/gemv.c``, the k-quants ``csrc/kquant_gemv.c``, through
``kernels.gemv``) vs the f32 references, their batch invariance, the decode dispatch, and what the
backend registers with and without them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance.cases import K_QUANT_F16_OFFSETS
from zllm.conformance.cases import make_weight as make_conformance_weight
from zllm.domain.linear import linear as ref_linear
from zllm.domain.linear import weight_to_f32
from zllm.kernels.registry import KernelRegistry
from zllm.weights.formats import QuantizedTensor
from zllm_backend_cpu import plugin
from zllm_backend_cpu.kernels import gemv as kernels
from zllm_backend_cpu.kernels import linear as torch_kernels
from zllm_backend_cpu.kernels.native import LIBRARY_PATH, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"native GEMV library: {unavailable_reason()}")

KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
QUANT = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *KQUANTS)
FORMATS = ("f32", "f16", "bf16", *QUANT)
DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
# largest |q| of each format's signed quants, or its unsigned q's midpoint (formats with a min m)
Q_RANGE = {"q8_0": 127, "q4_0": 8, "q5_0": 16, "q4_1": 7.5, "q5_1": 15.5}
WITH_MIN = ("q4_1", "q5_1")  # w = d * q + m: f16 m at block bytes 2-3
KQUANTS_WITH_MIN = ("q2_k", "q4_k", "q5_k")  # w = d * sc * q - dmin * m: f16 d and dmin (K_QUANT_F16_OFFSETS)


def block_of(fmt: str) -> int:
    """K must be a multiple of this (1: dense)."""
    return 256 if fmt in KQUANTS else 32 if fmt in QUANT else 1


def make_weight(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor | QuantizedTensor:
    """A random weight of ``fmt`` with O(1/sqrt(K)) entries, like a trained layer (formats with
    a min: ``m = -d * midpoint`` times a jitter, so weights have about zero mean; k-quants: the
    conformance kit's random super-blocks)."""
    if fmt in KQUANTS:
        return make_conformance_weight(g, fmt, n, k)
    if fmt in DENSE:
        return (torch.randn(n, k, generator=g) / k**0.5).to(DENSE[fmt])
    raw = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, 1, generator=g) / (Q_RANGE[fmt] * k**0.5)
    raw[..., :2] = d.half().view(torch.uint8)
    if fmt in WITH_MIN:
        m = -d * Q_RANGE[fmt] * (0.75 + 0.5 * torch.rand(n, k // 32, 1, generator=g))
        raw[..., 2:4] = m.half().view(torch.uint8)
    return QuantizedTensor(raw.view(n, -1), fmt, (n, k))


def kquant_parts(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A k-quant with mins split into its scale part ``d * sc * q`` and its min part ``-dmin * m``,
    f32 ``[N, K]`` each: the reference decode with ``dmin`` (then ``d``) zeroed."""
    d_at, dmin_at = K_QUANT_F16_OFFSETS[w.fmt]
    blocks = w.data.view(w.shape[0], w.shape[1] // 256, -1)
    parts = []
    for zero_at in (dmin_at, d_at):
        zeroed = blocks.clone()
        zeroed[..., zero_at:zero_at + 2] = 0
        parts.append(weight_to_f32(QuantizedTensor(zeroed.view_as(w.data), w.fmt, tuple(w.shape))))
    return parts[0], parts[1]


def assert_within_quantization_bound(got: torch.Tensor, x: torch.Tensor, w: QuantizedTensor, b: torch.Tensor | None):
    """Block formats (``csrc/gemv.c``): x is quantized to int16 per block of 32, ``s_b = max|x_b| / 32767``,
    so ``|y - y_ref| <= sum_b (s_b / 2) * sum_(i in b) |w_i|`` plus f32 rounding, against the exact
    product with the dequantized weights (here in f64). The f32 rounding: the kernel's ``x / s_b`` (2^-24
    of ``|x|`` per element), its scales ``d * s_b`` and block sums (2^-24 each) and the f32 sum over the
    ``K / 32`` blocks: ``(K / 32 + 8) * 2^-24`` of ``sum |w| |x|`` and of the bound itself, and 2^-123 a
    block where ``d * s_b`` is subnormal. Q4_1 / Q5_1 / Q4_K / Q5_K / Q2_K round the scale and min parts
    apart (and the reference rounds ``w``): their magnitude is ``sum (|d q| + |m|) |x|`` instead."""
    t, k = x.shape
    n, nb = w.shape[0], k // 32
    wd, xd = weight_to_f32(w).double(), x.double()  # the dequantized weights are exact in f32
    bd = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    ref = xd @ wd.t() + bd  # [T, N]
    s = xd.view(t, nb, 32).abs().amax(-1) / 32767  # [T, nb]
    bound = (s / 2) @ wd.abs().view(n, nb, 32).sum(-1).t()  # [T, N]
    parts = wd.abs()
    if w.fmt in WITH_MIN:
        m = w.data.view(n, nb, -1)[..., 2:4].contiguous().view(torch.float16).double()  # [N, nb, 1]
        parts = ((wd.view(n, nb, 32) - m).abs() + m.abs()).view(n, k)  # |d q| + |m|
    elif w.fmt in KQUANTS_WITH_MIN:
        scaled, mins = kquant_parts(w)
        parts = scaled.double().abs() + mins.double().abs()  # |d sc q| + |dmin m|
    magnitude = xd.abs() @ parts.t() + bd.abs()
    rounding = (nb + 8) * 2.0**-24 * (magnitude + bound) + nb * 2.0**-123
    err = (got.double() - ref).abs()
    worst = int((err - bound - rounding).argmax())
    assert bool((err <= bound + rounding).all()), (
        f"error {err.view(-1)[worst]:.3g} > bound {bound.view(-1)[worst]:.3g} "
        f"+ rounding {rounding.view(-1)[worst]:.3g}")


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def strided_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a non-contiguous view: rows 2 apart in a wider buffer."""
    t, k = x.shape
    buf = torch.full((2 * t, k + 5), float("nan"))
    buf[::2, :k] = x
    return buf[::2, :k]


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    t=st.sampled_from([1, 1, 2, 3, 4, 5, 8, 9, 13]),
    # rows: 1, odd, around the 4-row tiles, and (with small K) past one 64 KB work item
    n=st.one_of(st.integers(1, 70), st.sampled_from([511, 512, 513, 1029])),
    k_blocks=st.sampled_from([1, 2, 3, 5, 9, 40]),  # k-quants: 1, 2, 3, 5, 9 super-blocks (40 -> 4)
    k_extra=st.sampled_from([0, 0, 1, 7, 8, 15]),  # dense only: K need not be a multiple of 32
    bias=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_matches_reference(fmt, t, n, k_blocks, k_extra, bias, strided, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_blocks + (k_extra if fmt in DENSE else 0)
    if fmt in KQUANTS:
        k = 256 * (k_blocks if k_blocks < 40 else 4)
    w = make_weight(fmt, n, k, g)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.gemv(strided_rows(x) if strided else x, w, b)
    assert got.shape == (t, n) and got.dtype == torch.float32 and got.is_contiguous()
    if fmt in DENSE:  # the same f32 products of exactly converted weights, another summation order
        torch.testing.assert_close(got, ref_linear(x, w, b), atol=1e-5, rtol=1e-5)
    else:  # x quantized to int16 per block: the analytic bound
        assert_within_quantization_bound(got, x, w, b)


def extreme_rows(t: int, k: int, kinds: list[str], g: torch.Generator) -> torch.Tensor:
    """``x [T, K]`` whose 32-wide blocks each take one of ``kinds``."""
    x = torch.randn(t, k, generator=g)
    for i, kind in enumerate(kinds[: k // 32]):
        blk = x[:, 32 * i:32 * i + 32]
        if kind == "zeros":
            blk.zero_()
        elif kind == "huge":  # one value dwarfs the rest of its block
            blk[:, i % 32] = 1e30
        elif kind == "negative max":  # the largest magnitude is negative
            blk[:, (3 * i) % 32] = -50.0
        elif kind == "tiny":
            blk.mul_(1e-30)
        elif kind == "subnormal":  # the scale underflows to 0 or a subnormal
            blk.mul_(1e-41)
        elif kind == "one nonzero":
            blk.zero_()
            blk[:, (5 * i) % 32] = -3.5
    return x


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(QUANT),
    kinds=st.lists(st.sampled_from(["plain", "zeros", "huge", "negative max", "tiny", "subnormal", "one nonzero"]),
                   min_size=1, max_size=12),
    t=st.sampled_from([1, 2, 3, 5]),
    n=st.sampled_from([1, 7, 33, 600]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_gemv_stays_within_the_bound_for_extreme_activations(fmt, kinds, t, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = -(-32 * len(kinds) // block_of(fmt)) * block_of(fmt)  # k-quants: the blocks past the kinds are plain
    w = make_weight(fmt, n, k, g)
    x = extreme_rows(t, k, kinds, g)
    b = torch.randn(n, generator=g) if bias else None
    with threads(1):
        got = kernels.gemv(x, w, b)
        solo = torch.cat([kernels.gemv(x[i:i + 1], w, b) for i in range(t)])
    assert_within_quantization_bound(got, x, w, b)
    assert torch.equal(got, solo)  # batch-invariant
    with threads(2):
        assert torch.equal(kernels.gemv(x, w, b), solo)
    if all(kind in ("zeros", "tiny", "subnormal") for kind in kinds):
        assert bool(got.isfinite().all())
    if all(kind == "zeros" for kind in kinds) and k == 32 * len(kinds):  # s_b = 0: exactly the bias
        assert torch.equal(got, torch.zeros(t, n) if b is None else b.expand(t, n))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("k", [1, 3, 8, 9, 24, 31])
def test_gemv_with_fewer_in_features_than_one_vector_chunk(fmt, k):
    g = torch.Generator().manual_seed(k)
    w, x, b = make_weight(fmt, 9, k, g), torch.randn(3, k, generator=g), torch.randn(9, generator=g)
    torch.testing.assert_close(kernels.gemv(x, w, b), ref_linear(x, w, b), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fmt", [f for f in QUANT if f not in KQUANTS])  # gguf-py has no k-quant encoder
def test_gemv_on_blocks_quantized_by_the_gguf_package(fmt):
    g = torch.Generator().manual_seed(1)
    n, k = 37, 32 * 7
    w32 = torch.randn(n, k, generator=g).numpy()
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    blocks = gguf.quants.quantize(w32, qtype)  # uint8 [N, K / 32 * block bytes]
    w = QuantizedTensor(torch.from_numpy(np.ascontiguousarray(blocks)), fmt, (n, k))
    decoded = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype)))  # f32 [N, K]
    x = torch.randn(3, k, generator=g)
    assert torch.equal(weight_to_f32(w), decoded)
    assert_within_quantization_bound(kernels.gemv(x, w, None), x, w, None)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_kquant_gemv_is_within_the_bound_of_the_gguf_package_dequantized_weights(fmt):
    g = torch.Generator().manual_seed(5)
    n, k = 29, 256 * 3
    w = make_weight(fmt, n, k, g)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    decoded = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(w.data.numpy(), qtype)))  # f32 [N, K]
    x = torch.randn(4, k, generator=g)
    assert torch.equal(weight_to_f32(w), decoded)  # the bound below is against this decode
    assert_within_quantization_bound(kernels.gemv(x, w, None), x, w, None)


@pytest.mark.parametrize("fmt", ["q2_k", "q4_k"])
def test_kquant_min_sums_of_many_tokens_past_the_stack_buffer_give_each_row_its_solo_bits(fmt):
    # T * K / 32 (Q2_K: / 16) sums of x above kquant_gemv.c's 2048-float stack buffer: from malloc
    g = torch.Generator().manual_seed(6)
    t, n, k = 40, 9, 2048
    w, x = make_weight(fmt, n, k, g), torch.randn(t, k, generator=g)
    got = kernels.gemv(x, w, None)
    assert torch.equal(got, torch.cat([kernels.gemv(x[i:i + 1], w, None) for i in range(t)]))
    assert_within_quantization_bound(got, x, w, None)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS), n=st.sampled_from([1, 7, 64, 333, 1500]), k_blocks=st.sampled_from([1, 3, 24]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_rows_are_bit_identical_for_every_row_count_position_and_thread_count(fmt, n, k_blocks, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = max(32, block_of(fmt)) * k_blocks
    w = make_weight(fmt, n, k, g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(24, k, generator=g)
    with threads(1):
        solo = torch.cat([kernels.linear_gemv_invariant(x[i:i + 1], w, b) for i in range(24)])  # [24, N]
    for t in (1, 2, 3, 4, 5, 7, 8, 9, 16, 24):
        for off in range(0, 24 - t + 1, 5):
            assert torch.equal(kernels.linear_gemv_invariant(x[off:off + t], w, b), solo[off:off + t]), (t, off)
    noisy = x.clone()
    noisy[1:] = torch.randn(23, k, generator=g) * 1e3
    assert torch.equal(kernels.linear_gemv_invariant(noisy[:6], w, b)[0], solo[0])
    with threads(3):  # more threads than cores: more regions of the split than running threads
        assert torch.equal(kernels.linear_gemv_invariant(x, w, b), solo)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_gemv_runs_native_up_to_16_tokens_and_the_torch_kernel_above(fmt):
    g = torch.Generator().manual_seed(2)
    k = 3 * max(32, block_of(fmt))
    w = make_weight(fmt, 45, k, g)
    torch_kernel = torch_kernels.linear_dense if fmt in DENSE else torch_kernels.linear_quant
    for t in (1, 16, 17, 30):
        x = torch.randn(t, k, generator=g)
        expected = kernels.gemv(x, w, None) if t <= kernels.GEMV_MAX_TOKENS else torch_kernel(x, w, None)
        assert torch.equal(kernels.linear_gemv(x, w, None), expected), t


def test_gemv_rejects_a_format_it_has_not():
    w = make_conformance_weight(torch.Generator().manual_seed(0), "fp8_e4m3", 2, 256)  # quant_gemv's
    with pytest.raises(ValueError, match="no format 'fp8_e4m3'.*q8_0"):
        kernels.gemv(torch.zeros(1, 256), w, None)


def test_nan_scales_and_activations_propagate():
    g = torch.Generator().manual_seed(3)
    w = make_weight("q8_0", 8, 64, g)
    blocks = w.data.view(8, 2, 34)
    blocks[3, 1, :2] = torch.tensor([0x7E00], dtype=torch.int16).view(torch.uint8)  # f16 NaN scale in row 3
    x = torch.randn(2, 64, generator=g)
    x[1, 5] = float("nan")
    got = kernels.gemv(x, w, None)
    assert torch.equal(got.isnan(), torch.tensor([[False] * 3 + [True] + [False] * 4, [True] * 8]))


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_activation_makes_the_quantized_outputs_of_its_token_nan(fmt, value):
    g = torch.Generator().manual_seed(4)
    k = 3 * block_of(fmt)
    w = make_weight(fmt, 5, k, g)
    x = torch.randn(3, k, generator=g)
    x[1, 40] = value
    got = kernels.gemv(x, w, None)
    assert bool(got[1].isnan().all()) and bool(got[[0, 2]].isfinite().all())


# ----------------------------------------------------------------------------- registration


def test_native_kernels_take_decode_and_batch_invariant_linear_when_the_library_loads():
    reg = KernelRegistry()
    plugin.zllm_register_kernels(reg)
    for fmt in FORMATS:
        choice = reg.lookup("linear", "cpu", fmt)
        assert choice.entry.name == "zllm_backend_cpu.kernels.gemv:linear_gemv" and choice.entry.priority == 1
        assert "unavailable" not in choice.reason
    for fmt in FORMATS:
        choice = reg.lookup("linear", "cpu", fmt, batch_invariant=True)
        assert choice.entry.name == "zllm_backend_cpu.kernels.gemv:linear_gemv_invariant"


_WITHOUT_LIBRARY = """
import torch
from zllm.kernels.registry import KernelRegistry
import zllm_backend_cpu
from zllm_backend_cpu import plugin
from zllm_backend_cpu.kernels.gemv import gemv

print("FROM", zllm_backend_cpu.__file__)
reg = KernelRegistry()
plugin.zllm_register_kernels(reg)
for fmt, invariant in (("bf16", False), ("q8_0", False), ("f32", True), ("f32", False), ("q4_k", False)):
    choice = reg.lookup("linear", "cpu", fmt, batch_invariant=invariant)
    print("CHOICE", fmt, invariant, choice.entry.name, "|", choice.reason)
print("EMBEDDING", reg.lookup("embedding", "cpu", "q4_k").reason)
try:
    gemv(torch.zeros(1, 32), torch.zeros(2, 32), None)
except RuntimeError as e:
    print("ERROR", e)
"""


def test_without_the_library_the_torch_kernels_run_and_say_why(tmp_path):
    """An install whose build had no compiler: the package without ``_native.so``."""
    pkg = tmp_path / "zllm_backend_cpu"
    shutil.copytree(LIBRARY_PATH.parent, pkg, ignore=shutil.ignore_patterns("_native.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_LIBRARY], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"FROM {pkg / '__init__.py'}"
    choices = {tuple(line.split()[1:3]): line.split(" ", 3)[3] for line in lines if line.startswith("CHOICE")}
    why = "torch path: native kernels unavailable: _native.so was not built at install time"
    assert choices[("bf16", "False")].startswith("zllm_backend_cpu.kernels.linear:linear_dense |")
    assert choices[("q8_0", "False")].startswith("zllm_backend_cpu.kernels.linear:linear_quant |")
    assert choices[("q4_k", "False")].startswith("zllm_backend_cpu.kernels.linear:linear_quant |")
    assert choices[("f32", "True")].startswith("zllm_backend_cpu.kernels.invariant:linear_dense_invariant |")
    for key in (("bf16", "False"), ("q8_0", "False"), ("q4_k", "False"), ("f32", "True"), ("f32", "False")):
        assert why in choices[key], choices[key]
    # ops the native kernels would not serve anyway carry no note
    embedding = next(line for line in lines if line.startswith("EMBEDDING"))
    assert "unavailable" not in embedding
    assert any(line.startswith("ERROR native kernels unavailable: _native.so was not built") for line in lines)
