"""RMSNorm and fused add + RMSNorm kernels vs the f32 references, in the interpreter.

Rows of odd lengths, shorter and longer than the chunk (one pass in registers vs two
chunked passes), f32/f16/bf16 weights, and inputs that are row views of a wider tensor or
transposed (column-strided) ones.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zllm.domain.norm import add_rms_norm as ref_add_rms_norm
from zllm.domain.norm import rms_norm as ref_rms_norm
from zllm_kernels_triton.norm import add_rms_norm, rms_norm
from zllm_kernels_triton.tuning import Tuning

WEIGHT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def activations(t: int, k: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """f32 ``[t, k]``: contiguous, a row view of a wider tensor, or a transposed tensor."""
    if layout == "row_view":
        return torch.randn(t, k + 3, generator=g)[:, 1 : k + 1]
    if layout == "transposed":
        return torch.randn(k, t, generator=g).t()
    return torch.randn(t, k, generator=g)


norm_cases = dict(
    t=st.integers(1, 6),
    k=st.integers(1, 40),
    block=st.sampled_from([4, 8, 16, 4096]),
    weight_dtype=st.sampled_from(WEIGHT_DTYPES),
    layout=st.sampled_from(["contiguous", "row_view", "transposed"]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=20, deadline=None)
@given(**norm_cases)
@example(t=2, k=37, block=8, weight_dtype=torch.bfloat16, layout="row_view", eps=1e-6, seed=0)  # 5 chunks
def test_rms_norm_matches_reference(t, k, block, weight_dtype, layout, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = activations(t, k, layout, g)
    w = torch.randn(k, generator=g).to(weight_dtype)
    got = rms_norm(x, w, eps, tuning=Tuning(norm_block_k=block))
    assert got.shape == (t, k) and got.dtype == torch.float32
    # same f32 operations, another summation order for the mean: 1e-4
    torch.testing.assert_close(got, ref_rms_norm(x, w, eps), atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(**norm_cases)
@example(t=3, k=33, block=4, weight_dtype=torch.float16, layout="contiguous", eps=1e-5, seed=1)  # 9 chunks
def test_add_rms_norm_matches_reference(t, k, block, weight_dtype, layout, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = activations(t, k, layout, g)
    residual = activations(t, k, "row_view", g)
    w = torch.randn(k, generator=g).to(weight_dtype)
    normed, h = add_rms_norm(x, residual, w, eps, tuning=Tuning(norm_block_k=block))
    expected_normed, expected_h = ref_add_rms_norm(x, residual, w, eps)
    assert torch.equal(h, expected_h)  # one f32 add per element, exactly the reference's
    torch.testing.assert_close(normed, expected_normed, atol=1e-4, rtol=1e-4)


def test_rms_norm_scales_each_row_to_unit_rms():
    x = torch.tensor([[3.0, 4.0], [-1.0, 1.0]])
    out = rms_norm(x, torch.ones(2), 0.0, tuning=Tuning(norm_block_k=4))
    expected = torch.tensor([[3.0, 4.0], [-1.0, 1.0]]) / torch.tensor([[12.5**0.5], [1.0]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
