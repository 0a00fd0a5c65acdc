"""Reference linear/embedding/silu_mul vs torch's own functional ops, and the reference registry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities import Capability
from zllm.domain.activation import silu_mul
from zllm.domain.linear import embedding, linear
from zllm.domain.ops import CORE_CAPABILITIES, register_references
from zllm.domain.quant import dequantize
from zllm.kernels.registry import REFERENCE_BACKEND, KernelRegistry
from zllm.weights.formats import QuantizedTensor


def random_q8_0(rows: int, cols: int, g: torch.Generator) -> QuantizedTensor:
    raw = torch.randint(0, 256, (rows, cols // 32, 34), dtype=torch.uint8, generator=g)
    raw[..., :2] = (torch.rand(rows, cols // 32, 1, generator=g) * 0.01).half().view(torch.uint8)
    return QuantizedTensor(raw.view(rows, -1), "q8_0", (rows, cols))


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 5), n=st.integers(1, 40), k=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_linear_dense_is_f_linear_on_upcast_weight(t, n, k, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    # tolerance 1e-5: same f32 math, possibly another matmul blocking
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w.float(), b), atol=1e-5, rtol=1e-5)


def test_linear_and_embedding_on_q8_0():
    g = torch.Generator().manual_seed(0)
    w = random_q8_0(5, 64, g)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(linear(x, w, None), x @ dequantize(w).t(), atol=1e-6, rtol=1e-6)
    ids = torch.tensor([4, 0, 4])
    assert torch.equal(embedding(w, ids), dequantize(w)[ids])
    assert torch.equal(embedding(w, torch.empty(0, dtype=torch.int64)), torch.empty(0, 64))


def test_embedding_dense_and_bad_id():
    w = torch.randn(10, 4).bfloat16()
    assert torch.equal(embedding(w, torch.tensor([3, 9])), w[[3, 9]].float())
    with pytest.raises(AssertionError):
        embedding(w, torch.tensor([10]))


def test_silu_mul_matches_functional_silu():
    gate, up = torch.randn(4, 33) * 5, torch.randn(4, 33)
    torch.testing.assert_close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_references_cover_every_core_capability():
    registry = KernelRegistry()
    register_references(registry)
    registered = {Capability(e.op, f) for e in registry.entries() for f in e.formats if e.backend == REFERENCE_BACKEND}
    assert registered == CORE_CAPABILITIES
    assert all(e.registered_by == "zllm-core" for e in registry.entries())
    for cap in CORE_CAPABILITIES:  # every lazy reference resolves to a callable
        assert callable(registry.lookup(cap.op, "cpu", cap.variant, force_reference=True).fn)
    with pytest.raises(ValueError, match="already registered"):
        register_references(registry)
