"""Tiny quantizers for the HF checkpoints' formats, written from each format's definition:
f32 weights -> a :class:`QuantizedTensor` in the kernel layout of ``zllm.weights.formats``.

They make conformance cases and test checkpoints; they aim at correct encodings, not at the
best rounding a production quantizer (GPTQ's error feedback, AWQ's scale search) finds.
Dimension legend: ``L`` leading dimensions, ``N`` rows, ``K`` columns, ``g`` group size.

- ``fp8_e4m3``: per block of ``(bn, bk)`` weights, ``scale = amax / 448`` (E4M3FN's largest
  finite value; 1 for an all-zero block), ``q = e4m3(w / scale)`` rounded to nearest even.
- ``int4_g`` / ``int8_g``: per group of ``g`` columns, asymmetric ``scale = (max - min) /
  (2^b - 1)``, ``zero = round(-min / scale)``; symmetric ``scale = amax / (2^(b-1) - 1)``,
  ``zero = 2^(b-1)``; ``q = clamp(round(w / scale) + zero, 0, 2^b - 1)``.
- ``mxfp4``: per 32 columns, the E8M0 exponent ``floor(log2(amax)) - 2`` (E2M1's largest
  value 6 is ``1.5 * 2^2``; OCP MX spec section 6.3), values rounded to the nearest E2M1.
- ``nvfp4``: ``global_scale = amax(w) / (448 * 6)``, per 16 columns the E4M3 block scale
  ``amax_block / 6 / global_scale``, values rounded to the nearest E2M1 of
  ``w / (e4m3(block scale) * global_scale)``.
"""

from __future__ import annotations

import torch

from zllm.domain.quant_hf import E2M1_VALUES
from zllm.weights.formats import QuantizedTensor

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0


def _blockwise_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``max |w|`` over blocks ``(bn, bk)`` of ``w`` ``[N, K]``, partial edge blocks too:
    ``[ceil(N/bn), ceil(K/bk)]``."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
    return padded.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk)).amax(dim=(1, 3))


def quantize_fp8_e4m3(w: torch.Tensor, block: tuple[int, int] | None = None) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` -> ``fp8_e4m3`` with one f32 scale per ``block`` (default per tensor)."""
    n, k = w.shape
    bn, bk = block or (n, k)
    amax = _blockwise_amax(w, bn, bk)  # [ceil(N/bn), ceil(K/bk)]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedTensor({"qweight": q.contiguous(), "scale": scale.contiguous()}, "fp8_e4m3", (n, k),
                           block=(bn, bk))


def quantize_int_g(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` -> ``int4_g`` / ``int8_g`` with groups of ``group`` columns (dividing ``K``)."""
    n, k = w.shape
    assert bits in (4, 8) and k % group == 0, (bits, k, group)
    groups = w.view(n, k // group, group)  # [N, G, g]
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = groups.abs().amax(-1) / (half - 1)  # [N, G]
        zero = torch.full(scale.shape, half, dtype=torch.float32)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.where(scale > 0, (-lo / scale).round(), torch.zeros_like(scale)).clamp(0, top)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / scale[..., None]).round().add(zero[..., None]).clamp(0, top).to(torch.uint8).view(n, k)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble = even column
    return QuantizedTensor({"qweight": q.contiguous(), "scales": scale.contiguous(), "zeros": zero.to(torch.uint8)},
                           f"int{bits}_g", (n, k), block=(1, group))


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of the values nearest to ``x`` (magnitudes above 6 clamp to 6)."""
    magnitudes = E2M1_VALUES[:8]
    code = (x.abs().clamp(max=E2M1_MAX)[..., None] - magnitudes).abs().argmin(-1)  # [...], 0..7
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` -> ``[..., K/2]``, low nibble = even column."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def quantize_mxfp4(w: torch.Tensor) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` (``K`` a multiple of 32) -> ``mxfp4``."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    amax = blocks.abs().amax(-1)  # [N, K/32]
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    codes = _nearest_e2m1(blocks / torch.ldexp(torch.ones_like(amax), exponent.int())[..., None]).view(n, k)
    scales = (exponent + 127).to(torch.uint8)
    return QuantizedTensor({"qweight": _pack_nibbles(codes), "scales": scales}, "mxfp4", (n, k))


def quantize_nvfp4(w: torch.Tensor) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` (``K`` a multiple of 16) -> ``nvfp4``."""
    n, k = w.shape
    amax = w.abs().amax()
    global_scale = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else torch.tensor(1.0)
    blocks = w.view(n, k // 16, 16)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / global_scale).to(torch.float8_e4m3fn)  # [N, K/16]
    decoded_scale = block_scale.float() * global_scale
    safe = torch.where(decoded_scale > 0, decoded_scale, torch.ones_like(decoded_scale))
    codes = _nearest_e2m1(blocks / safe[..., None]).view(n, k)
    return QuantizedTensor({"qweight": _pack_nibbles(codes), "scales": block_scale.view(torch.uint8).contiguous(),
                            "global_scale": global_scale.float().reshape(())}, "nvfp4", (n, k))


def quantize(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``w`` f32 ``[N, K]`` in ``fmt`` with the conformance cases' choices: FP8 blocks of
    ``(16, 32)`` (odd shapes give partial blocks), asymmetric integer groups of 32.

    Raises:
        KeyError: ``fmt`` is none of this module's formats.
    """
    encoders = {
        "fp8_e4m3": lambda: quantize_fp8_e4m3(w, (16, 32)),
        "int4_g": lambda: quantize_int_g(w, 4, 32, symmetric=False),
        "int8_g": lambda: quantize_int_g(w, 8, 32, symmetric=False),
        "mxfp4": lambda: quantize_mxfp4(w),
        "nvfp4": lambda: quantize_nvfp4(w),
    }
    return encoders[fmt]()
