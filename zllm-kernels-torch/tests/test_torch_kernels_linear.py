"""zllm-kernels-torch embedding and linear vs the f32 references, on CPU tensors.

Q8_0 weights are encoded by the ``gguf`` package (llama.cpp's quantizer), so the decode is
checked against bytes this project did not write.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.linear import embedding as ref_embedding
from zllm.domain.linear import linear as ref_linear
from zllm.weights.formats import QuantizedTensor
from zllm_kernels_torch import linear as kernels

DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def weight(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor | QuantizedTensor:
    """A ``[n, k]`` weight with model-like scale (rows of unit norm), stored as ``fmt``."""
    w = torch.randn(n, k, generator=g) / k**0.5
    if fmt == "q8_0":
        data = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        return QuantizedTensor(torch.from_numpy(data), "q8_0", (n, k))
    return w.to(DENSE[fmt])


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["f32", "f16", "bf16", "q8_0"]), t=st.integers(1, 9), n=st.integers(1, 70),
       k=st.sampled_from([32, 64, 96, 256]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_matches_reference(fmt, t, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = weight(fmt, n, k, g)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    fn = kernels.linear_q8_0 if fmt == "q8_0" else kernels.linear_dense
    got = fn(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (t, n)
    if fmt in ("f32", "q8_0"):  # same f32 products, other summation order
        torch.testing.assert_close(got, ref_linear(x, w, b), atol=1e-5, rtol=1e-5)
    else:  # the GEMM runs in the weight dtype (module doc): the kernel tolerance
        torch.testing.assert_close(got, ref_linear(x, w, b), atol=1e-2, rtol=1e-2)


def test_q8_0_linear_decodes_tile_by_tile_across_tile_edges(monkeypatch):
    monkeypatch.setattr(kernels, "TILE_BYTES", 3 * 4 * 64)  # 3 rows of K = 64 per tile
    g = torch.Generator().manual_seed(0)
    w, x = weight("q8_0", 10, 64, g), torch.randn(2, 64, generator=g)
    torch.testing.assert_close(kernels.linear_q8_0(x, w, None), ref_linear(x, w, None), atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["f32", "f16", "bf16", "q8_0"]), v=st.integers(1, 50), k=st.sampled_from([32, 64]),
       ids=st.lists(st.integers(0, 49), min_size=0, max_size=12), seed=st.integers(0, 2**16))
def test_embedding_equals_reference_exactly(fmt, v, k, ids, seed):
    w = weight(fmt, v, k, torch.Generator().manual_seed(seed))
    index = torch.tensor([i % v for i in ids], dtype=torch.int64)
    fn = kernels.embedding_q8_0 if fmt == "q8_0" else kernels.embedding_dense
    assert torch.equal(fn(w, index), ref_embedding(w, index))


def test_q8_0_embedding_decodes_only_the_gathered_rows():
    w = weight("q8_0", 6, 32, torch.Generator().manual_seed(1))
    poisoned = w.data.clone()
    poisoned[[0, 2, 3, 5], :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # f16 +inf scale in unread rows
    ids = torch.tensor([4, 1, 4])
    got = kernels.embedding_q8_0(QuantizedTensor(poisoned, "q8_0", (6, 32)), ids)
    assert torch.equal(got, ref_embedding(w, ids))


@pytest.mark.parametrize("fn", [kernels.linear_dense, kernels.linear_q8_0])
def test_linear_rejects_non_f32_activations(fn):
    w = weight("q8_0" if fn is kernels.linear_q8_0 else "f32", 4, 32, torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        fn(torch.randn(2, 32, dtype=torch.float16), w, None)
