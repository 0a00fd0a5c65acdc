"""CPU linear/embedding kernels for the GGUF k-quants vs the f32 references.

Tolerances: the row decoders and ``embedding`` are exact (bit for bit, NaN-aware) — they do
the reference's f32 arithmetic; ``linear`` multiplies the same decoded f32 weights in another
summation order, so atol = rtol = 1e-5 on O(1) outputs.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tile_budget import tile_budget

from zllm.domain.linear import embedding as ref_embedding
from zllm.domain.linear import linear as ref_linear
from zllm.domain.quant import dequantize
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor
from zllm_backend_cpu.kernels import CAPABILITIES
from zllm_backend_cpu.kernels import linear as kernels
from zllm_backend_cpu.kernels.kquants import KQUANT_DECODERS

KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
QK_K = 256
# byte offsets of the f16 d (and dmin) of each super-block (ggml-common.h)
F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# |w| <= |d| * max|scale * q| (+ |dmin| * max min): choose d so that entries are O(1/sqrt(K))
MAX_SCALED_Q = {"q2_k": 45, "q3_k": 128, "q4_k": 945, "q5_k": 1953, "q6_k": 4096}


def make_kquant(fmt: str, n: int, k: int, g: torch.Generator) -> QuantizedTensor:
    """Random bytes for quants and sub-block scales; f16 d/dmin set so |w| ~ 1/sqrt(K)."""
    layout = BLOCK_LAYOUTS[fmt]
    raw = torch.randint(0, 256, (n, k // QK_K, layout.type_size), dtype=torch.uint8, generator=g)
    for offset in F16_FIELDS[fmt]:
        scale = torch.rand(n, k // QK_K, 1, generator=g) * 2 / (MAX_SCALED_Q[fmt] * k**0.5)
        raw[..., offset : offset + 2] = scale.half().view(torch.uint8)
    return QuantizedTensor(raw.view(n, -1), fmt, (n, k))


def test_backend_declares_linear_and_embedding_for_every_kquant():
    for fmt in KQUANTS:
        assert {f"linear[{fmt}]", f"embedding[{fmt}]"} <= set(map(str, CAPABILITIES))
    assert set(KQUANT_DECODERS) == set(KQUANTS) and set(KQUANTS) <= set(kernels.DECODERS)


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(KQUANTS),
    t=st.sampled_from([1, 1, 2, 7]),
    n=st.integers(1, 40),  # rows: rarely a multiple of the 16-row minimum tile
    k_blocks=st.integers(1, 3),
    bias=st.booleans(),
    tiny_tiles=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_reference(fmt, t, n, k_blocks, bias, tiny_tiles, seed):
    g = torch.Generator().manual_seed(seed)
    k = QK_K * k_blocks
    w = make_kquant(fmt, n, k, g)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with tile_budget(1 if tiny_tiles else None):
        got = kernels.linear_quant(x, w, b)
    expected = ref_linear(x, w, b)
    assert got.shape == (t, n) and got.dtype == torch.float32 and got.is_contiguous()
    # the same f32 products, another summation order
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(KQUANTS), v=st.integers(1, 30), k_blocks=st.integers(1, 2), t=st.integers(0, 9),
       seed=st.integers(0, 2**16))
def test_embedding_matches_reference_exactly(fmt, v, k_blocks, t, seed):
    g = torch.Generator().manual_seed(seed)
    w = make_kquant(fmt, v, QK_K * k_blocks, g)
    ids = torch.randint(0, v, (t,), generator=g)
    torch.testing.assert_close(kernels.embedding_quant(w, ids), ref_embedding(w, ids), atol=0, rtol=0)


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(KQUANTS), rows=st.integers(1, 4), k_blocks=st.integers(1, 3), data=st.data())
def test_decoders_match_reference_bit_for_bit_with_nan_and_inf_scales(fmt, rows, k_blocks, data):
    layout = BLOCK_LAYOUTS[fmt]
    n_bytes = rows * k_blocks * layout.type_size
    raw = torch.tensor(list(data.draw(st.binary(min_size=n_bytes, max_size=n_bytes))), dtype=torch.uint8)
    raw = raw.view(rows, k_blocks, layout.type_size)
    specials = torch.tensor([0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16)
    for offset in F16_FIELDS[fmt]:  # about half of the f16 fields forced to inf/NaN/subnormal/-0
        pick = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=rows * k_blocks, max_size=rows * k_blocks)))
        forced = specials[pick.clamp(max=4)].view(torch.uint8).view(rows, k_blocks, 2)
        field = raw[..., offset : offset + 2]
        field.copy_(torch.where((pick < 5).view(rows, k_blocks, 1), forced, field))
    w = QuantizedTensor(raw.view(rows, -1).contiguous(), fmt, (rows, QK_K * k_blocks))
    got, expected = KQUANT_DECODERS[fmt](w.data, w.shape[1]), dequantize(w)
    assert torch.equal(got.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(got[keep].view(torch.int32), expected[keep].view(torch.int32))
