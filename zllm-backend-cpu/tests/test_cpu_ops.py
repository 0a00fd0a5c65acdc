"""CPU rms_norm, rope and silu_mul kernels vs the f32 references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.activation import silu_mul as ref_silu_mul
from zllm.domain.norm import add_rms_norm as ref_add_rms_norm
from zllm.domain.norm import rms_norm as ref_rms_norm
from zllm.domain.rope import apply_rope, apply_rope_gptj, default_inv_freq, rope_cos_sin
from zllm_backend_cpu.kernels.activation import silu_mul
from zllm_backend_cpu.kernels.norm import add_rms_norm, rms_norm
from zllm_backend_cpu.kernels.rope import rope, rope_gptj


@settings(max_examples=30, deadline=None)
@given(
    t=st.sampled_from([1, 2, 7]), k=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(t, k, dtype, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * 4
    w = torch.randn(k, generator=g).to(dtype)
    # f32 op, fused reduction order differs: 1e-5
    torch.testing.assert_close(rms_norm(x, w, eps), ref_rms_norm(x, w, eps), atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    t=st.sampled_from([1, 3, 9]), h=st.integers(1, 5), d=st.sampled_from([2, 8, 64, 128]),
    theta=st.sampled_from([10000.0, 1e6]), seed=st.integers(0, 2**16),
)
def test_rope_matches_reference(t, h, d, theta, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (t,), generator=g), default_inv_freq(d, theta))
    before = x.clone()
    # same f32 element-wise formula: 1e-6
    torch.testing.assert_close(rope(x, cos, sin), apply_rope(x, cos, sin), atol=1e-6, rtol=1e-6)
    assert torch.equal(x, before)  # input untouched


@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 4]), n=st.integers(1, 500), seed=st.integers(0, 2**16))
def test_silu_mul_matches_reference(t, n, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(t, n, generator=g) * 6, torch.randn(t, n, generator=g)
    # F.silu vs x * sigmoid(x): an ulp or two apart: 1e-5 relative, 1e-6 absolute
    torch.testing.assert_close(silu_mul(gate, up), ref_silu_mul(gate, up), atol=1e-6, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 2, 7]), k=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_add_rms_norm_matches_reference(t, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(t, k, generator=g) * 4, torch.randn(t, k, generator=g)
    w = torch.randn(k, generator=g).to(dtype)
    y, h = add_rms_norm(x, r, w, 1e-5)
    ref_y, ref_h = ref_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from([1, 3]), h=st.integers(1, 5), d=st.sampled_from([2, 8, 64]), seed=st.integers(0, 2**16))
def test_gptj_rope_matches_reference_on_a_strided_view(t, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, 2 * h * d, generator=g)
    x = qkv[:, : h * d].view(t, h, d)  # a view into a wider projection, as the model passes it
    cos, sin = rope_cos_sin(torch.randint(0, 100_000, (t,), generator=g), default_inv_freq(d, 10000.0))
    torch.testing.assert_close(rope_gptj(x, cos, sin), apply_rope_gptj(x, cos, sin), atol=1e-6, rtol=1e-6)
