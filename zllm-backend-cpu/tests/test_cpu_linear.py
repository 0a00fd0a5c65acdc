"""CPU linear/embedding kernels vs the f32 references, every weight format."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tile_budget import tile_budget

from zllm.domain.linear import embedding as ref_embedding
from zllm.domain.linear import linear as ref_linear
from zllm.domain.quant import dequantize
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor
from zllm_backend_cpu.kernels import linear as kernels

DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCKS_32 = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# largest |q| of each format's signed quants, or its unsigned q's midpoint (formats with a min m)
Q_RANGE = {"q8_0": 127, "q4_0": 8, "q5_0": 16, "q4_1": 7.5, "q5_1": 15.5}
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2)}  # d (and m) offsets


def make_weight(fmt: str, n: int, k: int, g: torch.Generator, scale_bits: list[int] | None = None):
    """A random weight of ``fmt`` with O(1/sqrt(K)) entries, like a trained layer."""
    if fmt in DENSE:
        return (torch.randn(n, k, generator=g) / k**0.5).to(DENSE[fmt])
    layout = BLOCK_LAYOUTS[fmt]
    raw = torch.randint(0, 256, (n, k // 32, layout.type_size), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, 1, generator=g) / (Q_RANGE[fmt] * k**0.5)
    raw[..., :2] = d.half().view(torch.uint8)
    if len(F16_FIELDS[fmt]) == 2:  # m = -d * midpoint, jittered: weights of about zero mean
        raw[..., 2:4] = (
            (-d * Q_RANGE[fmt] * (0.75 + 0.5 * torch.rand(n, k // 32, 1, generator=g))).half().view(torch.uint8)
        )
    return QuantizedTensor(raw.view(n, -1), fmt, (n, k))


@settings(max_examples=50, deadline=None)
@given(
    fmt=st.sampled_from(["f32", "f16", "bf16", *BLOCKS_32]),
    t=st.sampled_from([1, 1, 2, 5, 17]),
    n=st.integers(1, 70),  # rows: rarely a multiple of the 16-row minimum tile
    k_blocks=st.integers(1, 6),
    bias=st.booleans(),
    tiny_tiles=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_matches_reference(fmt, t, n, k_blocks, bias, tiny_tiles, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_blocks
    w = make_weight(fmt, n, k, g)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with tile_budget(1 if tiny_tiles else None):
        fn = kernels.linear_quant if fmt in BLOCK_LAYOUTS else kernels.linear_dense
        got = fn(x, w, b)
    expected = ref_linear(x, w, b)
    assert got.shape == (t, n) and got.dtype == torch.float32 and got.is_contiguous()
    if fmt == "f32" or (fmt in DENSE and t > 1) or fmt in BLOCK_LAYOUTS:
        # the same f32 products, another summation order: 1e-5
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        # T == 1 bf16/f16 multiplies in the weight dtype (module doc): DESIGN tolerance 1e-2
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_f16_decode_with_huge_activation_stays_finite():
    w = torch.randn(8, 64).half()
    x = torch.randn(1, 64)
    x[0, 3] = 1e6  # would overflow f16
    got = kernels.linear_dense(x, w, None)
    assert bool(got.isfinite().all())
    torch.testing.assert_close(got, ref_linear(x, w, None), atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["f32", "f16", "bf16", *BLOCKS_32]),
    v=st.integers(1, 40),
    k_blocks=st.integers(1, 4),
    t=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_embedding_matches_reference_exactly(fmt, v, k_blocks, t, seed):
    g = torch.Generator().manual_seed(seed)
    w = make_weight(fmt, v, 32 * k_blocks, g)
    ids = torch.randint(0, v, (t,), generator=g)
    fn = kernels.embedding_quant if fmt in BLOCK_LAYOUTS else kernels.embedding_dense
    # gathering and decoding are the same f32 arithmetic as the reference: exact (tolerance 0)
    torch.testing.assert_close(fn(w, ids), ref_embedding(w, ids), atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(BLOCKS_32), rows=st.integers(1, 5), k_blocks=st.integers(1, 4), data=st.data())
def test_decoders_match_reference_bit_for_bit_with_nan_and_inf_scales(fmt, rows, k_blocks, data):
    layout = BLOCK_LAYOUTS[fmt]
    n_bytes = rows * k_blocks * layout.type_size
    raw = torch.tensor(list(data.draw(st.binary(min_size=n_bytes, max_size=n_bytes))), dtype=torch.uint8)
    raw = raw.view(rows, k_blocks, layout.type_size)
    specials = torch.tensor([0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8000], dtype=torch.int32)
    pick = torch.tensor(data.draw(st.lists(st.integers(0, 9), min_size=rows * k_blocks, max_size=rows * k_blocks)))
    forced = (specials[pick.clamp(max=4)] .to(torch.int16)).view(torch.uint8).view(rows, k_blocks, 2)
    for offset in F16_FIELDS[fmt]:  # the scale d and, where the format has one, the min m
        field = raw[..., offset:offset + 2]
        field.copy_(torch.where((pick < 5).view(rows, k_blocks, 1), forced, field))
    w = QuantizedTensor(raw.view(rows, -1).contiguous(), fmt, (rows, 32 * k_blocks))
    got, expected = kernels.DECODERS[fmt](w.data, w.shape[1]), dequantize(w)
    assert torch.equal(got.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(got[keep].view(torch.int32), expected[keep].view(torch.int32))
