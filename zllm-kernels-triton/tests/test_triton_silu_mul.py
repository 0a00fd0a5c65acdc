"""``silu_mul`` kernel vs the f32 reference, in the interpreter, on the halves of a fused gate/up output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.activation import silu_mul as ref_silu_mul
from zllm_kernels_triton.activation import silu_mul
from zllm_kernels_triton.tuning import Tuning


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 9),
    n=st.integers(1, 70),
    block=st.sampled_from([4, 8, 16, 1024]),
    layout=st.sampled_from(["fused_gate_up", "transposed"]),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_matches_reference(t, n, block, layout, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "fused_gate_up":
        gate_up = torch.randn(t, 2 * n, generator=g) * 4
        gate, up = gate_up[:, :n], gate_up[:, n:]
    else:
        gate, up = torch.randn(n, t, generator=g).t() * 4, torch.randn(n, t, generator=g).t()
    got = silu_mul(gate, up, tuning=Tuning(silu_block_n=block))
    assert got.shape == (t, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref_silu_mul(gate, up), atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's NumPy exp
def test_silu_saturates_without_overflow():
    gate = torch.tensor([[-1000.0, 0.0, 1000.0]])
    out = silu_mul(gate, torch.ones(1, 3))
    assert out.tolist() == [[0.0, 0.0, 1000.0]]
