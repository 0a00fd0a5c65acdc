"""The CPU row-tile decoders of the HF checkpoints' formats equal the f32 reference bit for bit,
tile by tile (tiles that cut FP8 scale blocks included), and ``linear`` / ``embedding`` over
them agree with the reference ops; GPTQ's act-order permutation is honoured."""

from __future__ import annotations

import pytest
import torch

from zllm.conformance import quantizers
from zllm.domain.linear import embedding as embedding_ref
from zllm.domain.linear import linear as linear_ref
from zllm.domain.quant import dequantize
from zllm.weights.formats import QuantizedTensor
from zllm_backend_cpu.kernels import linear as kernels

N, K = 41, 96
WEIGHTS = {
    "fp8-blocks": lambda w: quantizers.quantize_fp8_e4m3(w, (24, 64)),  # 16-row tiles cut the 24-row blocks
    "fp8-channel": lambda w: quantizers.quantize_fp8_e4m3(w, (1, K)),
    "fp8-tensor": lambda w: quantizers.quantize_fp8_e4m3(w, None),
    "int4": lambda w: quantizers.quantize_int_g(w, 4, 32, symmetric=False),
    "int8": lambda w: quantizers.quantize_int_g(w, 8, 48, symmetric=True),
    "mxfp4": quantizers.quantize_mxfp4,
    "nvfp4": quantizers.quantize_nvfp4,
}


def _act_order(w: QuantizedTensor) -> QuantizedTensor:
    """``w`` with its stored columns declared a permutation of the logical ones."""
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(7))
    return QuantizedTensor({**w.parts, "perm": perm}, w.fmt, w.shape, block=w.block)


@pytest.fixture(params=sorted(WEIGHTS) + ["int4-act-order"])
def weight(request) -> QuantizedTensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    if request.param == "int4-act-order":
        return _act_order(WEIGHTS["int4"](w))
    return WEIGHTS[request.param](w)


def test_row_tiles_decode_to_the_references_rows_exactly(weight, monkeypatch):
    monkeypatch.setattr(kernels, "TILE_BYTES", 16 * 4 * K)  # 16-row tiles: 41 rows in 3 tiles
    expected = dequantize(weight)
    buf = torch.empty(16 * K)
    for start in range(0, N, 16):
        stop = min(N, start + 16)
        got = kernels._decode_rows(weight, start, stop, buf[: (stop - start) * K].view(stop - start, K))
        assert torch.equal(got, expected[start:stop])


def test_linear_and_embedding_match_the_reference_ops(weight, monkeypatch):
    monkeypatch.setattr(kernels, "TILE_BYTES", 16 * 4 * K)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kernels.linear_quant(x, weight, bias), linear_ref(x, weight, bias), atol=1e-5, rtol=1e-5)
    ids = torch.tensor([40, 0, 17, 17, 23])
    assert torch.equal(kernels.embedding_quant(weight, ids), embedding_ref(weight, ids))
