"""zllm-kernels-torch RMSNorm, fused residual add, RoPE (both layouts) and SiLU-gate vs the f32 references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.activation import silu_mul as ref_silu_mul
from zllm.domain.norm import add_rms_norm as ref_add_rms_norm
from zllm.domain.norm import rms_norm as ref_rms_norm
from zllm.domain.rope import apply_rope, apply_rope_gptj, default_inv_freq, rope_cos_sin
from zllm_kernels_torch.activation import silu_mul
from zllm_kernels_torch.norm import add_rms_norm, rms_norm
from zllm_kernels_torch.rope import rope_gptj, rope_neox

TIGHT = dict(atol=1e-5, rtol=1e-5)  # same f32 math, possibly another association order
SEEDS = st.integers(0, 2**16)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 9), k=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       eps=st.sampled_from([1e-6, 1e-5, 0.0]), seed=SEEDS)
def test_rms_norm_and_fused_add_match_reference(t, k, dtype, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(t, k, generator=g) * 3, torch.randn(t, k, generator=g)
    w = torch.randn(k, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, eps), ref_rms_norm(x, w, eps), **TIGHT)
    normed, h = add_rms_norm(x, residual, w, eps)
    ref_normed, ref_h = ref_add_rms_norm(x, residual, w, eps)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(normed, ref_normed, **TIGHT)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 9), h=st.integers(1, 5), d=st.sampled_from([2, 8, 64, 96]),
       layout=st.sampled_from(["neox", "gptj"]), seed=SEEDS)
def test_rope_matches_reference_for_each_layout(t, h, d, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    positions = torch.randint(0, 4096, (t,), generator=g)
    cos, sin = rope_cos_sin(positions, default_inv_freq(d, 10000.0))
    kernel, reference = (rope_neox, apply_rope) if layout == "neox" else (rope_gptj, apply_rope_gptj)
    torch.testing.assert_close(kernel(x, cos, sin), reference(x, cos, sin), **TIGHT)


def test_rope_layouts_differ_only_by_a_feature_permutation():
    # gptj pairs (2i, 2i+1) are neox pairs (i, i + D/2) after interleaving the halves
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, generator=g)
    cos, sin = rope_cos_sin(torch.tensor([5, 9]), default_inv_freq(8, 10000.0))
    interleave = torch.arange(8).view(2, 4).t().reshape(-1)  # [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(rope_gptj(x[..., interleave], cos, sin), rope_neox(x, cos, sin)[..., interleave])


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), n=st.integers(1, 500), seed=SEEDS)
def test_silu_mul_matches_reference(t, n, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(t, n, generator=g) * 4, torch.randn(t, n, generator=g)
    torch.testing.assert_close(silu_mul(gate, up), ref_silu_mul(gate, up), **TIGHT)
