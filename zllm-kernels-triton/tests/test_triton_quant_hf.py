"""``linear`` over the HF checkpoints' formats (``quant_hf``) vs the registry's f32 reference decode
(``zllm.domain.quant``: dequantize, then ``x @ W^T + b``), in the interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance import quantizers
from zllm.domain.linear import linear as ref_linear
from zllm.weights.formats import QuantizedTensor
from zllm_kernels_triton.quant_hf import linear_quant_hf
from zllm_kernels_triton.tuning import Tuning

SMALL = Tuning(linear_block_m=4, linear_block_n=8, linear_block_k=32)
FORMATS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")


def quantized(fmt: str, n: int, k: int, g: torch.Generator, group: int, block: tuple[int, int]) -> QuantizedTensor:
    w = torch.randn(n, k, generator=g) / k**0.5
    if fmt == "fp8_e4m3":
        return quantizers.quantize_fp8_e4m3(w, block)
    if fmt in ("int4_g", "int8_g"):
        return quantizers.quantize_int_g(w, int(fmt[3]), group, symmetric=group == 16)
    return quantizers.quantize(w, fmt)


@settings(max_examples=6, deadline=None)
@given(fmt=st.sampled_from(FORMATS), t=st.integers(1, 5), n=st.integers(1, 20), k_units=st.integers(1, 3),
       group=st.sampled_from([16, 32]), block=st.sampled_from([(1, 32), (7, 40), (5, 16)]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_linear_matches_the_reference_decode(fmt, t, n, k_units, group, block, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_units
    w = quantized(fmt, n, k, g, group, block)
    x = torch.randn(t, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(linear_quant_hf(x, w, b, tuning=SMALL), ref_linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_act_order_reads_the_permuted_activations():
    g = torch.Generator().manual_seed(1)
    w = quantizers.quantize_int_g(torch.randn(12, 64, generator=g), 4, 32, symmetric=False)
    w = QuantizedTensor({**w.parts, "perm": torch.randperm(64, generator=g)}, "int4_g", w.shape, block=w.block)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(linear_quant_hf(x, w, None, tuning=SMALL), ref_linear(x, w, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("convert", ["bits", "e4m3fn"])
def test_every_e4m3_byte_and_e8m0_scale_decode_exactly(convert):
    # one-hot activations pick every weight out: all 254 finite E4M3FN bytes (by integer
    # arithmetic, or by the device's float8e4nv conversion), then MXFP4 blocks with the
    # extreme E8M0 scales 2^-127 (an f32 subnormal) and 2^127
    q = torch.arange(256, dtype=torch.uint8)
    q = q[(q & 0x7F) != 0x7F].view(2, 127).contiguous()
    w = QuantizedTensor({"qweight": q, "scale": torch.ones(1, 1)}, "fp8_e4m3", (2, 127), block=(2, 127))
    one_program = Tuning(linear_block_m=128, linear_block_n=2, linear_block_k=128, fp8_convert=convert)
    got = linear_quant_hf(torch.eye(127), w, None, tuning=one_program)
    assert torch.equal(got, q.view(torch.float8_e4m3fn).float().t())
    codes = torch.full((2, 16), 0x21, dtype=torch.uint8)  # columns: 0.5, 1.0, 0.5, 1.0 ...
    mx = QuantizedTensor({"qweight": codes, "scales": torch.tensor([[0], [254]], dtype=torch.uint8)}, "mxfp4", (2, 32))
    got = linear_quant_hf(torch.eye(32)[:2], mx, None, tuning=SMALL)
    assert got.tolist() == [[0.5 * 2.0**-127, 0.5 * 2.0**127], [2.0**-127, 2.0**127]]


def test_tuning_declares_the_fp8_conversion():
    with pytest.raises(ValueError, match="fp8_convert = 'e4m3fnuz'"):
        Tuning(fp8_convert="e4m3fnuz")
