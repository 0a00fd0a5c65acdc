"""Native GEMV and row decode of the HF quantized kernel layouts (``csrc/quant_gemv.c`` through
``kernels.quant_gemv``) vs an f32 decode of each layout, hand-built bytes, torch's own
``float8_e4m3fn``, act-order permutations and batch invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm_backend_cpu.kernels import quant_gemv as kernels
from zllm_backend_cpu.kernels.native import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}")

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` -> int64 ``[N, K]``: low nibble = even column."""
    return torch.stack([q & 15, q >> 4], -1).flatten(-2).long()


def e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).float()


def reference_decode(fmt: str, parts: dict, block: tuple[int, int] | None) -> torch.Tensor:
    """f32 ``[N, K]`` straight from the kernel-layout table of issue #14."""
    q = parts["qweight"]
    if fmt == "fp8_e4m3":
        bn, bk = block
        n, k = q.shape
        s = parts["scale"].repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return e4m3(q) * s
    if fmt in ("int4_g", "int8_g"):
        qs = nibbles(q) if fmt == "int4_g" else q.long()
        g = qs.shape[1] // parts["scales"].shape[1]
        z = parts["zeros"].long().repeat_interleave(g, 1)
        return parts["scales"].repeat_interleave(g, 1) * (qs - z).float()
    values = E2M1[nibbles(q)]
    if fmt == "mxfp4":
        return values * torch.exp2(parts["scales"].float() - 127).repeat_interleave(32, 1)
    return values * e4m3(parts["scales"]).repeat_interleave(16, 1) * parts["global_scale"]


def random_parts(fmt: str, n: int, k: int, g: torch.Generator, group: int = 32, bn: int = 128, bk: int = 128,
                 zero_point: bool = True) -> dict:
    """Random parts of a ``fmt`` weight ``[N, K]`` with O(1/sqrt(K)) entries, no NaN bytes."""
    def u8(*shape, high=256):
        return torch.randint(0, high, shape, dtype=torch.uint8, generator=g)

    if fmt == "fp8_e4m3":
        q = u8(n, k)
        q[(q & 0x7F) == 0x7F] = 0x7E  # no NaN: a checkpoint holds none
        scale = torch.rand(-(-n // bn), -(-k // bk), generator=g) / (100 * k**0.5)
        return {"qweight": q, "scale": scale}
    if fmt in ("int4_g", "int8_g"):
        bits = 4 if fmt == "int4_g" else 8
        q = u8(n, k // 2) if bits == 4 else u8(n, k)
        zeros = u8(n, k // group, high=2**bits) if zero_point else torch.full((n, k // group), 2 ** (bits - 1),
                                                                               dtype=torch.uint8)
        scales = torch.rand(n, k // group, generator=g) / (2 ** (bits - 1) * k**0.5)
        return {"qweight": q, "scales": scales, "zeros": zeros}
    if fmt == "mxfp4":
        scales = torch.randint(115, 125, (n, k // 32), dtype=torch.uint8, generator=g)  # 2^-12 .. 2^-3
        return {"qweight": u8(n, k // 2), "scales": scales}
    scales = (torch.rand(n, k // 16, generator=g) * 4 + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"qweight": u8(n, k // 2), "scales": scales, "global_scale": torch.tensor(0.3 / k**0.5)}


LAYOUT_CASES = st.sampled_from(["fp8_block", "fp8_channel", "fp8_tensor", "fp8_ragged", "int4_g", "int4_sym",
                                "int8_g", "int8_sym", "mxfp4", "nvfp4"])


def make_case(case: str, n: int, k_units: int, g: torch.Generator) -> tuple[str, dict, tuple[int, int] | None]:
    """(layout, parts, fp8 block) of a named case with ``N = n`` and ``K`` a multiple of 32."""
    k = 32 * k_units
    if case.startswith("fp8"):
        bn, bk = {"fp8_block": (16, 32), "fp8_channel": (1, k), "fp8_tensor": (n, k), "fp8_ragged": (7, 40)}[case]
        return "fp8_e4m3", random_parts("fp8_e4m3", n, k, g, bn=bn, bk=bk), (bn, bk)
    if case in ("int4_g", "int4_sym", "int8_g", "int8_sym"):
        fmt = case[:4] + "_g"
        group = (16, 32, 64)[k_units % 3] if k_units % 2 == 0 else (16, 32)[k_units % 2 + n % 2 - 1]
        return fmt, random_parts(fmt, n, k, g, group=group, zero_point=case.endswith("_g")), None
    return case, random_parts(case, n, k, g), None


@settings(max_examples=30, deadline=None)
@given(case=LAYOUT_CASES, t=st.integers(1, 3), n=st.integers(1, 40), k_units=st.integers(1, 6),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_matches_the_f32_decode_of_every_layout(case, t, n, k_units, bias, seed):
    g = torch.Generator().manual_seed(seed)
    fmt, parts, block = make_case(case, n, k_units, g)
    w = reference_decode(fmt, parts, block)  # [N, K]
    x = torch.randn(t, w.shape[1], generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.quant_gemv(x, fmt, parts, b, block=block)
    if fmt == "fp8_e4m3":  # exact quants, f32 products; the block sums are rounded before scaling
        ref = x.double() @ w.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    else:
        assert_within_quantization_bound(got, x, w, b)


def assert_within_quantization_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """int4_g / int8_g / mxfp4 / nvfp4 (``csrc/quant_gemv.c``, as gemv.c's GGUF blocks): x is quantized
    to int16 per block of 32, ``s_b = max|x_b| / 32767``, so ``|y - y_ref| <= sum_b (s_b / 2) * sum_(i in b)
    |w_i|`` against the exact product with the decoded weights (f64 here), plus f32 rounding: of ``x / s_b``,
    of the scales and of the sum over the ``K / 32`` blocks, ``(K / 32 + 8) * 2^-24`` of ``sum |w| |x|``."""
    t, k = x.shape
    n, nb = w.shape[0], k // 32
    wd, xd = w.double(), x.double()
    ref = xd @ wd.t() + (0 if b is None else b.double())  # [T, N]
    s = xd.view(t, nb, 32).abs().amax(-1) / 32767  # [T, nb]
    bound = (s / 2) @ wd.abs().view(n, nb, 32).sum(-1).t()  # [T, N]
    magnitude = xd.abs() @ wd.abs().t() + (0 if b is None else b.double().abs())
    rounding = (nb + 8) * 2.0**-24 * (magnitude + bound) + nb * 2.0**-120
    err = (got.double() - ref).abs()
    assert bool((err <= bound + rounding).all()), f"worst excess {float((err - bound - rounding).max()):.3g}"


@settings(max_examples=20, deadline=None)
@given(case=LAYOUT_CASES, n=st.integers(1, 24), k_units=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_row_decode_equals_the_f32_decode(case, n, k_units, seed):
    g = torch.Generator().manual_seed(seed)
    fmt, parts, block = make_case(case, n, k_units, g)
    start = n // 3
    got = kernels.decode_rows(fmt, parts, start, n, block=block)
    torch.testing.assert_close(got, reference_decode(fmt, parts, block)[start:], atol=0, rtol=0)


def test_prefill_tiles_match_the_gemv_and_apply_act_order():
    g = torch.Generator().manual_seed(0)
    parts = random_parts("int4_g", 48, 128, g)
    parts["perm"] = torch.randperm(128, generator=g)
    x = torch.randn(kernels.GEMV_MAX_TOKENS + 3, 128, generator=g)
    w = reference_decode("int4_g", parts, None)  # columns in group order
    ref = x[:, parts["perm"]] @ w.t()
    torch.testing.assert_close(kernels.quant_linear(x, "int4_g", parts, None), ref, atol=1e-5, rtol=1e-5)
    assert_within_quantization_bound(kernels.quant_linear(x[:2], "int4_g", parts, None), x[:2, parts["perm"]], w, None)


def test_an_output_row_does_not_depend_on_the_other_tokens():
    g = torch.Generator().manual_seed(1)
    parts = random_parts("nvfp4", 33, 96, g)
    x = torch.randn(5, 96, generator=g)
    alone = kernels.quant_gemv(x[2:3], "nvfp4", parts, None)
    assert torch.equal(kernels.quant_gemv(x, "nvfp4", parts, None)[2:3], alone)


def test_every_e4m3_byte_decodes_as_torch_float8_e4m3fn():
    q = torch.arange(256, dtype=torch.uint8)
    q = q[(q & 0x7F) != 0x7F].view(2, -1)  # [2, 127]: all but the two NaN bytes
    parts = {"qweight": q.contiguous(), "scale": torch.ones(1, 1)}
    torch.testing.assert_close(kernels.decode_rows("fp8_e4m3", parts, 0, 2, block=(2, 127)), e4m3(q), atol=0, rtol=0)
    # the GEMV's F16C path: x = one-hot columns picks each weight out
    x = torch.eye(127)
    torch.testing.assert_close(kernels.quant_gemv(x, "fp8_e4m3", parts, None, block=(2, 127)), e4m3(q).t(),
                               atol=0, rtol=0)


def test_hand_built_fp4_and_int4_bytes():
    # mxfp4 row: byte 0x9A = high nibble 9 (-0.5, column 1), low nibble 0xA (-1.0, column 0); byte 0x70 = 6.0
    # at column 3 and 0 at column 2; the other 28 columns 0; scale byte 128 = 2^1.
    q = torch.zeros(1, 16, dtype=torch.uint8)
    q[0, 0], q[0, 1] = 0x9A, 0x70
    mx = {"qweight": q, "scales": torch.tensor([[128]], dtype=torch.uint8)}
    assert kernels.decode_rows("mxfp4", mx, 0, 1)[0, :4].tolist() == [-2.0, -1.0, 0.0, 12.0]
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([32767.0, 2.0, 5.0, 4.0])  # s_b = 1: the activations quantize exactly
    assert kernels.quant_gemv(x, "mxfp4", mx, None).item() == -2.0 * 32767 - 1.0 * 2 + 12.0 * 4
    # nvfp4: the same bytes in one 16-column group, scale byte 0x38 (E4M3 1.0), global 0.25
    nv = {"qweight": q[:, :8].contiguous(), "scales": torch.tensor([[0x38]], dtype=torch.uint8),
          "global_scale": torch.tensor(0.25)}
    assert kernels.decode_rows("nvfp4", nv, 0, 1)[0, :4].tolist() == [-0.25, -0.125, 0.0, 1.5]
    # int4 with zero point 3, scale 0.5: byte 0x9A = q 10 (column 0), 9 (column 1) -> 3.5, 3.0
    i4 = {"qweight": q[:, :8].contiguous(), "scales": torch.tensor([[0.5]]),
          "zeros": torch.tensor([[3]], dtype=torch.uint8)}
    assert kernels.decode_rows("int4_g", i4, 0, 1)[0, :4].tolist() == [3.5, 3.0, -1.5, 2.0]


def test_bad_parts_are_named():
    g = torch.Generator().manual_seed(2)
    parts = random_parts("int8_g", 4, 64, g)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="'zeros'"):
        kernels.quant_gemv(x, "int8_g", {k: v for k, v in parts.items() if k != "zeros"}, None)
    with pytest.raises(ValueError, match="'scales' is torch.float16"):
        kernels.quant_gemv(x, "int8_g", {**parts, "scales": parts["scales"].half()}, None)
    with pytest.raises(ValueError, match="multiple of 32 or 16"):
        kernels.quant_gemv(torch.randn(1, 96), "int8_g", random_parts("int8_g", 4, 96, g, group=48), None)
    with pytest.raises(ValueError, match="block shape"):
        kernels.quant_gemv(x, "fp8_e4m3", random_parts("fp8_e4m3", 4, 64, g), None)
    with pytest.raises(ValueError, match="no layout 'q3_x'"):
        kernels.quant_gemv(x, "q3_x", parts, None)
