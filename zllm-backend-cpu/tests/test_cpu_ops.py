"""CPU rms_norm, add_rms_norm, rope and silu_mul kernels vs the f32 references: the torch
kernels and the native ones (``csrc/elementwise.c``), each test run on both."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.activation import silu_mul as ref_silu_mul
from zllm.domain.norm import add_rms_norm as ref_add_rms_norm
from zllm.domain.norm import rms_norm as ref_rms_norm
from zllm.domain.rope import apply_rope, apply_rope_gptj, default_inv_freq, rope_cos_sin
from zllm_backend_cpu.kernels import activation, norm
from zllm_backend_cpu.kernels import rope as torch_rope
from zllm_backend_cpu.kernels.native import unavailable_reason

TORCH = SimpleNamespace(rms_norm=norm.rms_norm, add_rms_norm=norm.add_rms_norm, rope=torch_rope.rope,
                        rope_gptj=torch_rope.rope_gptj, silu_mul=activation.silu_mul)
NATIVE_MISSING = pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")
IMPLS = pytest.mark.parametrize("impl", ["torch", pytest.param("native", marks=NATIVE_MISSING)])


def kernels(impl: str):
    """The kernel functions of one implementation (the native module loads the library on import)."""
    return TORCH if impl == "torch" else importlib.import_module("zllm_backend_cpu.kernels.elementwise")


@IMPLS
@settings(max_examples=30, deadline=None)
@given(
    t=st.sampled_from([1, 2, 7]), k=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(impl, t, k, dtype, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * 4
    w = torch.randn(k, generator=g).to(dtype)
    # f32 op, fused reduction order differs: 1e-5
    torch.testing.assert_close(kernels(impl).rms_norm(x, w, eps), ref_rms_norm(x, w, eps), atol=1e-5, rtol=1e-5)


@IMPLS
@settings(max_examples=30, deadline=None)
@given(
    t=st.sampled_from([1, 3, 9]), h=st.integers(1, 5), d=st.sampled_from([2, 8, 64, 128]),
    theta=st.sampled_from([10000.0, 1e6]), seed=st.integers(0, 2**16),
)
def test_rope_matches_reference(impl, t, h, d, theta, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (t,), generator=g), default_inv_freq(d, theta))
    before = x.clone()
    # same f32 element-wise formula: 1e-6
    torch.testing.assert_close(kernels(impl).rope(x, cos, sin), apply_rope(x, cos, sin), atol=1e-6, rtol=1e-6)
    assert torch.equal(x, before)  # input untouched


@IMPLS
@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 4]), n=st.integers(1, 500), seed=st.integers(0, 2**16))
def test_silu_mul_matches_reference(impl, t, n, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(t, n, generator=g) * 6, torch.randn(t, n, generator=g)
    # F.silu vs x * sigmoid(x): an ulp or two apart: 1e-5 relative, 1e-6 absolute
    torch.testing.assert_close(kernels(impl).silu_mul(gate, up), ref_silu_mul(gate, up), atol=1e-6, rtol=1e-5)


@IMPLS
@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 2, 7]), k=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_reference(impl, t, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(t, k, generator=g) * 4, torch.randn(t, k, generator=g)
    w = torch.randn(k, generator=g).to(dtype)
    y, h = kernels(impl).add_rms_norm(x, r, w, 1e-5)
    ref_y, ref_h = ref_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)


@IMPLS
@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 3]), h=st.integers(1, 5), d=st.sampled_from([2, 8, 64]), seed=st.integers(0, 2**16))
def test_gptj_rope_matches_reference_on_a_strided_view(impl, t, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, 2 * h * d, generator=g)
    x = qkv[:, : h * d].view(t, h, d)  # a view into a wider projection, as the model passes it
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (t,), generator=g), default_inv_freq(d, 10000.0))
    torch.testing.assert_close(kernels(impl).rope_gptj(x, cos, sin), apply_rope_gptj(x, cos, sin), atol=1e-6, rtol=1e-6)


# ---- the native kernels' own contract: views, batch invariance, threads, exp range ----


def _native():
    return kernels("native")


@NATIVE_MISSING
@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), k=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_native_norms_read_row_strided_views_and_leave_inputs_alone(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    wide_x, wide_r = torch.randn(t, k + 5, generator=g), torch.randn(t, 2 * k, generator=g)
    x, r = wide_x[:, 3 : 3 + k], wide_r[:, k:]  # row stride != K
    w = torch.randn(k, generator=g)
    before = (wide_x.clone(), wide_r.clone(), w.clone())
    torch.testing.assert_close(_native().rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    y, h = _native().add_rms_norm(x, r, w, 1e-5)
    ref_y, ref_h = ref_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, (wide_x, wide_r, w), strict=True))


@NATIVE_MISSING
@pytest.mark.parametrize("layout", ["rope", "rope_gptj"])
def test_native_rope_is_bit_identical_to_the_torch_kernel_on_fused_qkv_views(layout):
    g = torch.Generator().manual_seed(0)
    t, h, hkv, d = 5, 8, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    cos, sin = rope_cos_sin(torch.arange(100, 100 + t), default_inv_freq(d, 10000.0))
    assert torch.equal(getattr(_native(), layout)(k, cos, sin), getattr(TORCH, layout)(k, cos, sin))


@NATIVE_MISSING
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "rope", "silu_mul"])
def test_native_rows_are_batch_and_thread_invariant(op):
    """A row's result is bit-identical alone, inside a batch large enough for the threaded
    path (>= 2^15 elements), and with one or two threads."""
    g = torch.Generator().manual_seed(1)
    t, k, h, d = 64, 1024, 16, 64
    x, r, w = torch.randn(t, k, generator=g), torch.randn(t, k, generator=g), torch.randn(k, generator=g)
    q = torch.randn(t, h, d, generator=g)
    cos, sin = rope_cos_sin(torch.arange(t), default_inv_freq(d, 10000.0))
    calls = {
        "rms_norm": lambda i: _native().rms_norm(x[i], w, 1e-5),
        "add_rms_norm": lambda i: torch.cat(_native().add_rms_norm(x[i], r[i], w, 1e-5), dim=-1),
        "rope": lambda i: _native().rope(q[i], cos[i], sin[i]),
        "silu_mul": lambda i: _native().silu_mul(x[i], r[i]),
    }
    threads = torch.get_num_threads()
    try:
        whole = [calls[op](slice(None))]
        torch.set_num_threads(1)
        whole.append(calls[op](slice(None)))
    finally:
        torch.set_num_threads(threads)
    rows = torch.cat([calls[op](slice(i, i + 1)) for i in range(t)])
    assert torch.equal(whole[0], rows) and torch.equal(whole[1], rows)


@NATIVE_MISSING
def test_native_silu_mul_over_the_whole_exp_range():
    """Large magnitudes saturate as silu does (g -> g, g -> -0), NaN propagates."""
    gate = torch.tensor([[-200.0, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 100.0, 200.0,
                          float("nan"), 3.0, -3.0]])
    up = torch.ones_like(gate)
    got = _native().silu_mul(gate, up)
    want = ref_silu_mul(gate, up)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, equal_nan=True)


@NATIVE_MISSING
def test_native_kernels_hand_inputs_they_do_not_take_to_the_torch_kernels():
    """A float64 norm weight and a head-dim-strided RoPE input run the torch kernels, with
    the reference's result rather than a wrong read."""
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w = torch.randn(40, generator=g, dtype=torch.float64)
    torch.testing.assert_close(_native().rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    y, h = _native().add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(y, ref_add_rms_norm(x, r, w, 1e-5)[0], atol=1e-5, rtol=1e-5)
    q = torch.randn(2, 3, 16, 2, generator=g)[..., 0]  # [T, H, D] with stride 2 along D
    cos, sin = rope_cos_sin(torch.arange(2), default_inv_freq(16, 10000.0))
    torch.testing.assert_close(_native().rope(q, cos, sin), apply_rope(q, cos, sin), atol=1e-6, rtol=1e-6)
