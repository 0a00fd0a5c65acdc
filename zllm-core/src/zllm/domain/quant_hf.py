"""f32 reference decodes of the quantized formats HF checkpoints bring: ``fp8_e4m3``,
``int4_g`` / ``int8_g``, ``mxfp4``, ``nvfp4``, in their kernel layouts
(:mod:`zllm.weights.formats`; the checkpoint's own packings are undone at load by
:mod:`zllm.weights.hf_quant`).

Dimension legend: ``L`` leading dimensions (experts), ``N`` rows (out-features), ``K``
columns (in-features), ``G = K / g`` groups per row, ``(bn, bk)`` the block one scale covers.

Every function takes a :class:`QuantizedTensor` of shape ``(*L, N, K)`` and returns f32 of that
shape; slice ``e`` of an expert stack decodes to ``dequantize(w)[e]``. Each result is one
f32 rounding of the exact product (the quantized values and scales are exact in f32), in the
order the defining libraries compute it, against which ``tests`` check these bit for bit:

- ``fp8_e4m3``: ``e4m3(q) * scale`` — transformers' ``FP8Linear`` dequantization
  (``integrations/finegrained_fp8.py``) and compressed-tensors' ``dequantize``.
- ``int4_g`` / ``int8_g``: ``scales * (q - zeros)`` (the integer difference is exact) — GPTQ's
  ``scales * (w - z)``, AWQ's ``(w - z) * scales``, compressed-tensors' ``(x_q - zp) * scale``.
- ``mxfp4``: ``e2m1(nibble) * 2^(scale - 127)`` — transformers' ``convert_moe_packed_tensors``
  (``ldexp``; a scale byte of 255 decodes to inf there and here).
- ``nvfp4``: ``e2m1(nibble) * (e4m3(scales) * global_scale)`` — the block scale is formed
  first, as modelopt's ``NVFP4QTensor.dequantize`` and compressed-tensors do (the latter
  divides by its ``weight_global_scale``, whose reciprocal ``global_scale`` is).

E2M1 values (OCP Microscaling Formats v1.0, section 5.3.3): bit 3 sign, magnitudes
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for codes 0..7.
"""

from __future__ import annotations

import torch

from zllm.weights.formats import QuantizedTensor

#: E2M1 code (0..15) -> value; bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip


def e4m3_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes uint8 ``[...]`` -> f32 ``[...]`` (exact; ``0x7f``/``0xff`` are NaN)."""
    assert bits.dtype == torch.uint8, bits.dtype
    return bits.view(torch.float8_e4m3fn).float()


def e8m0_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes uint8 ``[...]`` -> f32 ``2^(b - 127)`` (exact; 255 gives inf, as
    ``torch.ldexp`` in transformers' MXFP4 conversion)."""
    assert bits.dtype == torch.uint8, bits.dtype
    return torch.ldexp(torch.ones(bits.shape), bits.to(torch.int32) - 127)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 ``[..., K]``: byte ``j``'s low nibble is column ``2j``, its high
    nibble column ``2j + 1``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # [..., K]


def _expand(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """A per-block scale ``[*L, ceil(N/bn), ceil(K/bk)]`` repeated to every weight: ``[*L, N, K]``."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequantize_fp8_e4m3(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize an ``fp8_e4m3`` weight: ``e4m3(qweight[n, k]) * scale[n // bn, k // bk]``, f32
    ``[*L, N, K]``. Rows and columns need not be block multiples (the last block is partial).

    Raises:
        AssertionError: ``w`` is not ``fp8_e4m3``.
    """
    assert w.fmt == "fp8_e4m3", w.fmt
    *_, n, k = w.shape
    return e4m3_to_f32(w.parts["qweight"]) * _expand(w.parts["scale"], w.block_shape, n, k)


def dequantize_int_g(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize an ``int4_g`` / ``int8_g`` weight: ``scales[n, k // g] * (q[n, k] - zeros[n, k // g])``,
    f32 ``[*L, N, K]`` in logical column order (an act-order ``perm`` is undone: stored column
    ``j`` is logical column ``perm[j]``).

    Raises:
        AssertionError: ``w`` is not ``int4_g`` or ``int8_g``.
    """
    assert w.fmt in ("int4_g", "int8_g"), w.fmt
    *_, n, k = w.shape
    q = w.parts["qweight"]
    q = unpack_nibbles(q) if w.fmt == "int4_g" else q  # [*L, N, K] unsigned
    g = w.block_shape[1]
    zeros = w.parts["zeros"].repeat_interleave(g, dim=-1)  # [*L, N, K]
    scales = w.parts["scales"].repeat_interleave(g, dim=-1)  # [*L, N, K]
    stored = scales * (q.to(torch.int32) - zeros.to(torch.int32)).float()  # [*L, N, K], stored column order
    perm = w.parts.get("perm")
    if perm is None:
        return stored
    out = torch.empty_like(stored)
    return out.scatter_(-1, perm.unsqueeze(-2).expand(stored.shape), stored)  # out[..., perm[j]] = stored[..., j]


def dequantize_mxfp4(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize an ``mxfp4`` weight: ``e2m1(nibble) * 2^(scales[n, k // 32] - 127)``, f32 ``[*L, N, K]``.

    Raises:
        AssertionError: ``w`` is not ``mxfp4``.
    """
    assert w.fmt == "mxfp4", w.fmt
    values = E2M1_VALUES[unpack_nibbles(w.parts["qweight"]).long()]  # [*L, N, K]
    return values * e8m0_to_f32(w.parts["scales"]).repeat_interleave(32, dim=-1)


def dequantize_nvfp4(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize an ``nvfp4`` weight: ``e2m1(nibble) * (e4m3(scales[n, k // 16]) * global_scale)``,
    f32 ``[*L, N, K]``.

    Raises:
        AssertionError: ``w`` is not ``nvfp4``.
    """
    assert w.fmt == "nvfp4", w.fmt
    values = E2M1_VALUES[unpack_nibbles(w.parts["qweight"]).long()]  # [*L, N, K]
    block_scale = e4m3_to_f32(w.parts["scales"]) * w.parts["global_scale"][..., None, None]  # [*L, N, K/16]
    return values * block_scale.repeat_interleave(16, dim=-1)
