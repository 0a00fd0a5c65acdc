"""Native GEMV and row decode of the HF checkpoints' formats (``csrc/quant_gemv.c`` through
``kernels.quant_gemv``) vs the registry's f32 reference decodes (``zllm.domain.quant``), on
random parts and on weights of the conformance quantizers; hand-built bytes, torch's own
``float8_e4m3fn``, act-order permutations, expert stacks in the MoE kernel and batch invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance import quantizers
from zllm.domain.moe import RouterConfig
from zllm.domain.moe import moe as ref_moe
from zllm.domain.quant import dequantize
from zllm.weights.formats import QuantizedTensor
from zllm_backend_cpu.kernels import quant_gemv as kernels
from zllm_backend_cpu.kernels.moe_gemv import moe_gemv
from zllm_backend_cpu.kernels.native import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")


def random_weight(fmt: str, n: int, k: int, g: torch.Generator, block: tuple[int, int] | None = None,
                  zero_point: bool = True) -> QuantizedTensor:
    """A ``fmt`` weight ``[N, K]`` of random bytes with scales giving O(1/sqrt(K)) entries (no
    NaN bytes: a checkpoint holds none). ``block``: fp8's ``(bn, bk)`` or the int group ``(1, g)``."""
    def u8(*shape: int, high: int = 256) -> torch.Tensor:
        return torch.randint(0, high, shape, dtype=torch.uint8, generator=g)

    if fmt == "fp8_e4m3":
        bn, bk = block or (n, k)
        q = u8(n, k)
        q[(q & 0x7F) == 0x7F] = 0x7E
        scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) / (100 * k**0.5)
        return QuantizedTensor({"qweight": q, "scale": scale}, fmt, (n, k), block=(bn, bk))
    if fmt in ("int4_g", "int8_g"):
        bits, group = int(fmt[3]), (block or (1, 32))[1]
        zeros = u8(n, k // group, high=2**bits) if zero_point else torch.full((n, k // group), 2 ** (bits - 1),
                                                                               dtype=torch.uint8)
        scales = torch.rand(n, k // group, generator=g) / (2 ** (bits - 1) * k**0.5)
        return QuantizedTensor({"qweight": u8(n, k * bits // 8), "scales": scales, "zeros": zeros}, fmt, (n, k),
                               block=(1, group))
    if fmt == "mxfp4":
        scales = torch.randint(115, 125, (n, k // 32), dtype=torch.uint8, generator=g)  # 2^-12 .. 2^-3
        return QuantizedTensor({"qweight": u8(n, k // 2), "scales": scales}, fmt, (n, k))
    scales = (torch.rand(n, k // 16, generator=g) * 4 + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedTensor({"qweight": u8(n, k // 2), "scales": scales, "global_scale": torch.tensor(0.3 / k**0.5)},
                           fmt, (n, k))


CASES = ("fp8_block", "fp8_channel", "fp8_tensor", "fp8_ragged", "int4_g", "int4_sym", "int8_g", "int8_sym",
         "mxfp4", "nvfp4")


def make_case(case: str, n: int, k_units: int, g: torch.Generator) -> QuantizedTensor:
    """A weight of a named case with ``N = n``, ``K = 32 * k_units``; int groups of 16, 32 or 64."""
    k = 32 * k_units
    if case.startswith("fp8"):
        block = {"fp8_block": (16, 32), "fp8_channel": (1, k), "fp8_tensor": (n, k), "fp8_ragged": (7, 40)}[case]
        return random_weight("fp8_e4m3", n, k, g, block)
    if case.startswith("int"):
        group = 64 if k_units % 2 == 0 and n % 2 else (16, 32)[n % 3 == 0]
        return random_weight(case[:4] + "_g", n, k, g, (1, group), zero_point=not case.endswith("_sym"))
    return random_weight(case, n, k, g)


def assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, w: QuantizedTensor, b: torch.Tensor | None):
    """Exactly decoded quants times f32 activations, summed per scale group and scaled once: the
    reference's products in another rounding order, so within 1e-5 of its exact (f64) result."""
    ref = x.double() @ dequantize(w).double().t() + (0 if b is None else b.double())  # [T, N]
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(case=st.sampled_from(CASES), t=st.integers(1, 3), n=st.integers(1, 40), k_units=st.integers(1, 6),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_matches_the_reference_decode_of_every_format(case, t, n, k_units, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = make_case(case, n, k_units, g)
    x = torch.randn(t, w.shape[1], generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert_close_to_reference(kernels.quant_gemv(x, w, b), x, w, b)


@settings(max_examples=15, deadline=None)
@given(case=st.sampled_from(CASES), n=st.integers(1, 24), k_units=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_row_decode_equals_the_reference_decode_bit_for_bit(case, n, k_units, seed):
    g = torch.Generator().manual_seed(seed)
    w = make_case(case, n, k_units, g)
    start = n // 3
    assert torch.equal(kernels.decode_rows(w, start, n), dequantize(w)[start:])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4"])
def test_quantized_trained_like_weights_through_decode_and_prefill(fmt):
    # the conformance quantizers' encodings of a real-valued weight, K not a multiple of 32 for
    # fp8 (its GEMV takes any K) and a prefill batch through the tiled decode
    g = torch.Generator().manual_seed(3)
    k = 80 if fmt == "fp8_e4m3" else 96
    w = quantizers.quantize(torch.randn(24, k, generator=g) / k**0.5, fmt)
    x = torch.randn(kernels.GEMV_MAX_TOKENS + 2, k, generator=g)
    b = torch.randn(24, generator=g)
    prefill = kernels.linear_quant_gemv(x, w, b)
    torch.testing.assert_close(prefill, x @ dequantize(w).t() + b, atol=1e-5, rtol=1e-5)
    assert_close_to_reference(kernels.linear_quant_gemv(x[:3], w, b), x[:3], w, b)


def test_act_order_permutes_the_activations_in_gemv_and_prefill():
    g = torch.Generator().manual_seed(0)
    w = random_weight("int4_g", 48, 128, g, (1, 32))
    w = QuantizedTensor({**w.parts, "perm": torch.randperm(128, generator=g)}, "int4_g", w.shape, block=w.block)
    x = torch.randn(kernels.GEMV_MAX_TOKENS + 3, 128, generator=g)
    torch.testing.assert_close(kernels.linear_quant_gemv(x, w, None), x @ dequantize(w).t(), atol=1e-5, rtol=1e-5)
    assert_close_to_reference(kernels.linear_quant_gemv(x[:2], w, None), x[:2], w, None)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8_g", "nvfp4"])
def test_the_invariant_kernel_gives_each_row_the_same_bits_for_any_row_count(fmt):
    g = torch.Generator().manual_seed(1)
    w = random_weight(fmt, 33, 96, g, (16, 32) if fmt == "fp8_e4m3" else None)
    x = torch.randn(kernels.GEMV_MAX_TOKENS + 4, 96, generator=g)  # past the decode GEMV's row count
    alone = torch.cat([kernels.linear_quant_gemv_invariant(x[i:i + 1], w, None) for i in range(x.shape[0])])
    assert torch.equal(kernels.linear_quant_gemv_invariant(x, w, None), alone)
    assert torch.equal(kernels.linear_quant_gemv_invariant(x[3:9], w, None), alone[3:9])


def test_every_e4m3_byte_decodes_as_torch_float8_e4m3fn():
    q = torch.arange(256, dtype=torch.uint8)
    q = q[(q & 0x7F) != 0x7F].view(2, -1).contiguous()  # [2, 127]: all but the two NaN bytes
    w = QuantizedTensor({"qweight": q, "scale": torch.ones(1, 1)}, "fp8_e4m3", (2, 127), block=(2, 127))
    expected = q.view(torch.float8_e4m3fn).float()
    assert torch.equal(kernels.decode_rows(w, 0, 2), expected)
    # the GEMV's F16C path: one-hot activations pick each weight out
    assert torch.equal(kernels.quant_gemv(torch.eye(127), w, None), expected.t())


def test_hand_built_fp4_and_int4_bytes():
    # byte 0x9A: low nibble 0xA (column 0), high nibble 9 (column 1); byte 0x70: 0 (column 2), 7 (column 3)
    q = torch.zeros(1, 16, dtype=torch.uint8)
    q[0, 0], q[0, 1] = 0x9A, 0x70
    # mxfp4: E2M1 0xA = -1.0, 9 = -0.5, 7 = 6.0; scale byte 128 = 2^1
    mx = QuantizedTensor({"qweight": q, "scales": torch.tensor([[128]], dtype=torch.uint8)}, "mxfp4", (1, 32))
    assert kernels.decode_rows(mx, 0, 1)[0, :4].tolist() == [-2.0, -1.0, 0.0, 12.0]
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([3.0, 2.0, 5.0, 4.0])
    assert kernels.quant_gemv(x, mx, None).item() == -2.0 * 3 - 1.0 * 2 + 12.0 * 4
    # nvfp4: the same codes in 16-column groups, scale bytes 0x38 (E4M3 1.0) and 0x40 (2.0), global 0.25
    nv = QuantizedTensor({"qweight": q, "scales": torch.tensor([[0x38, 0x40]], dtype=torch.uint8),
                          "global_scale": torch.tensor(0.25)}, "nvfp4", (1, 32))
    assert kernels.decode_rows(nv, 0, 1)[0, :4].tolist() == [-0.25, -0.125, 0.0, 1.5]
    x[0, 16] = 8.0  # column 16: nibble 0 of byte 8 -> 0
    assert kernels.quant_gemv(x, nv, None).item() == 0.25 * (-3 - 0.5 * 2 + 6.0 * 4)
    # int4 with zero point 3, scale 0.5: q 10, 9, 0, 7 -> 3.5, 3.0, -1.5, 2.0
    i4 = QuantizedTensor({"qweight": q, "scales": torch.tensor([[0.5]]),
                          "zeros": torch.tensor([[3]], dtype=torch.uint8)}, "int4_g", (1, 32), block=(1, 32))
    assert kernels.decode_rows(i4, 0, 1)[0, :4].tolist() == [3.5, 3.0, -1.5, 2.0]


def expert_stack(fmt: str, e: int, n: int, k: int, g: torch.Generator) -> QuantizedTensor:
    """``E`` conformance-quantized experts ``[N, K]`` stacked part by part: ``[E, N, K]``."""
    ws = [quantizers.quantize(torch.randn(n, k, generator=g) / k**0.5, fmt) for _ in range(e)]
    return QuantizedTensor({p: torch.stack([w.parts[p] for w in ws]) for p in ws[0].parts}, fmt, (e, n, k),
                           block=ws[0].block)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4_g", "mxfp4", "nvfp4"])
def test_moe_gemv_takes_expert_stacks(fmt):
    g = torch.Generator().manual_seed(4)
    e, hidden, inter = 4, 64, 32
    x = torch.randn(3, hidden, generator=g)
    logits = torch.randn(3, e, generator=g)
    cfg = RouterConfig(e, 2, norm_topk_prob=True)
    gate, up, down = (expert_stack(fmt, e, inter, hidden, g), expert_stack(fmt, e, inter, hidden, g),
                      expert_stack(fmt, e, hidden, inter, g))
    got = moe_gemv(x, logits, cfg, gate, up, down)
    torch.testing.assert_close(got, ref_moe(x, logits, cfg, gate, up, down), atol=1e-3, rtol=1e-3)


def test_odd_shapes_take_the_gemv_too():
    # K not a multiple of 16 and int4 groups of 6 columns (scalar tails inside every group)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 36, generator=g)
    for w in (random_weight("int4_g", 5, 36, g, (1, 6)), random_weight("int8_g", 5, 36, g, (1, 12)),
              random_weight("fp8_e4m3", 5, 36, g, (3, 20))):
        assert_close_to_reference(kernels.quant_gemv(x, w, None), x, w, None)
        assert torch.equal(kernels.decode_rows(w, 0, 5), dequantize(w))


def test_non_contiguous_parts_are_read_through_copies():
    # a row slice of a wider buffer: parts with a row stride larger than their width
    g = torch.Generator().manual_seed(5)
    w = random_weight("int4_g", 8, 64, g, (1, 32))
    strided = QuantizedTensor({name: torch.cat([t, t], dim=-1)[..., : t.shape[-1]] for name, t in w.parts.items()},
                              "int4_g", w.shape, block=w.block)
    assert not strided.parts["qweight"].is_contiguous()
    x = torch.randn(2, 64, generator=g)
    assert torch.equal(kernels.quant_gemv(x, strided, None), kernels.quant_gemv(x, w, None))
    assert torch.equal(kernels.decode_rows(strided, 0, 8), kernels.decode_rows(w, 0, 8))


def test_weights_the_native_kernels_do_not_take_are_named():
    x = torch.randn(1, 96)
    with pytest.raises(ValueError, match="no format 'q8_0'"):
        kernels.quant_gemv(x, QuantizedTensor(torch.zeros(4, 102, dtype=torch.uint8), "q8_0", (4, 96)), None)
    stack = expert_stack("mxfp4", 2, 4, 96, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"2-D weight, got shape \[2, 4, 96\]"):
        kernels.quant_gemv(x, stack, None)
