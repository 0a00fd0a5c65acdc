"""``linear[q8_0]`` kernel vs the f32 reference (dequantize, then ``x @ W^T + b``), in the interpreter."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import random_q8_0

from zllm.domain.linear import linear as ref_linear
from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton.quant_matmul import linear_q8_0
from zllm_kernels_triton.tuning import Tuning

TILES = st.sampled_from([(4, 4, 32), (8, 8, 64), (16, 16, 32), None])  # (block_m, block_n, block_k) or the defaults


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 9),
    n=st.integers(1, 40),
    k_blocks=st.integers(1, 4),
    bias=st.booleans(),
    tiles=TILES,
    row_view=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_q8_0_matches_reference(t, n, k_blocks, bias, tiles, row_view, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_blocks
    w = random_q8_0(n, k, g)
    x = torch.randn(t, k + 5, generator=g)[:, 2 : k + 2] if row_view else torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    tuning = (Tuning() if tiles is None
              else Tuning(linear_block_m=tiles[0], linear_block_n=tiles[1], linear_block_k=tiles[2]))
    got = linear_q8_0(x, w, b, tuning=tuning)
    assert got.shape == (t, n) and got.dtype == torch.float32
    # exact dequantized weights, f32 products, another summation order: 1e-4
    torch.testing.assert_close(got, ref_linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_hand_built_q8_0_blocks_decode_scale_and_signed_quants():
    # Row 0: block 0 has d = -0.5 (f16 0xB800, stored little endian: 00 B8) and qs = -16 .. 15;
    # block 1 has d = 2^-24 (the smallest f16 subnormal: 01 00) and qs = 127 everywhere.
    # Row 1: d = 1.0 (00 3C) and qs = -128 then 0s, then d = 0 with qs = 1.
    qs = torch.arange(-16, 16, dtype=torch.int8).view(torch.uint8)
    row0 = torch.cat([torch.tensor([0x00, 0xB8], dtype=torch.uint8), qs,
                      torch.tensor([0x01, 0x00], dtype=torch.uint8), torch.full((32,), 127, dtype=torch.uint8)])
    lone = torch.zeros(32, dtype=torch.uint8)
    lone[0] = 0x80  # int8 -128
    row1 = torch.cat([torch.tensor([0x00, 0x3C], dtype=torch.uint8), lone,
                      torch.tensor([0x00, 0x00], dtype=torch.uint8), torch.ones(32, dtype=torch.uint8)])
    w = QuantizedTensor(torch.stack([row0, row1]), "q8_0", (2, 64))
    x = torch.ones(1, 64)
    out = linear_q8_0(x, w, torch.tensor([0.25, 0.0]),
                      tuning=Tuning(linear_block_m=4, linear_block_n=4, linear_block_k=32))
    expected_row0 = -0.5 * sum(range(-16, 16)) + 2.0**-24 * 127 * 32 + 0.25
    torch.testing.assert_close(out, torch.tensor([[expected_row0, -128.0]]), atol=0, rtol=1e-6)
