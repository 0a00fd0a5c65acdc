"""Row-tile decoders for the quantized formats HF checkpoints bring (``fp8_e4m3``,
``int4_g``/``int8_g``, ``mxfp4``, ``nvfp4``; kernel layouts in ``zllm.weights.formats``).

Dimension legend: ``R`` rows of a tile, ``K`` in-features, ``G`` scale groups per row,
``g`` columns per group.

:mod:`.linear` decodes a weight a row tile at a time into one reused f32 buffer; these
decoders write a tile ``w.rows(start:stop)`` (its parts are views of the weight's, except an
FP8 block scale, gathered per row) into ``out`` f32 ``[R, K]``. The arithmetic is the
reference's (``zllm.domain.quant_hf``): one f32 rounding of the exact product of a decoded
value and its scale, so tiles equal the reference's rows bit for bit. An act-order ``perm``
(GPTQ ``desc_act``) is not undone here: :mod:`.linear` permutes the activations instead
(``x[:, perm] @ W_stored^T``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.plugin_api import QuantizedTensor

#: E2M1 code -> value (OCP Microscaling Formats v1.0; bit 3 is the sign).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip


def _grouped(out: torch.Tensor, g: int) -> torch.Tensor:
    """``out`` f32 ``[R, K]`` viewed as ``[R, G, g]`` (``K`` a multiple of ``g``)."""
    r, k = out.shape
    return out.view(r, k // g, g)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, K/2]`` -> the nibbles as uint8 ``[R, K]`` (low nibble = even column)."""
    r, half = packed.shape
    nibbles = torch.empty(r, half, 2, dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=nibbles[..., 0])
    torch.bitwise_right_shift(packed, 4, out=nibbles[..., 1])
    return nibbles.view(r, 2 * half)


def decode_fp8_e4m3(w: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """``e4m3(q) * scale`` of a tile, f32 ``[R, K]`` into ``out``; the scale covers ``(1, bk)``
    after :meth:`QuantizedTensor.rows` (the last column block may be partial)."""
    r, k = w.shape
    out.copy_(w.parts["qweight"].view(torch.float8_e4m3fn))  # exact
    scale = w.parts["scale"]  # [R, ceil(K / bk)]
    bk = w.block_shape[1]
    full = k // bk * bk
    if full:
        _grouped(out[:, :full], bk).mul_(scale[:, : k // bk, None])
    if full < k:
        out[:, full:].mul_(scale[:, -1:])
    return out


def decode_int_g(w: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """``scales * (q - zeros)`` of a tile in stored column order, f32 ``[R, K]`` into ``out``."""
    r, k = w.shape
    q = w.parts["qweight"]
    q = _nibbles(q) if w.fmt == "int4_g" else q  # uint8 [R, K]
    g = w.block_shape[1]
    grouped = _grouped(out, g)  # [R, G, g]
    grouped.copy_(q.view(r, k // g, g))
    grouped.sub_(w.parts["zeros"][..., None])  # exact: small integers
    grouped.mul_(w.parts["scales"][..., None])
    return out


def decode_mxfp4(w: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """``e2m1 * 2^(scale - 127)`` of a tile, f32 ``[R, K]`` into ``out``."""
    codes = _nibbles(w.parts["qweight"])  # uint8 [R, K]
    torch.index_select(_E2M1, 0, codes.view(-1).long(), out=out.view(-1))
    exponent = w.parts["scales"].to(torch.int32) - 127  # [R, G]
    _grouped(out, 32).mul_(torch.ldexp(torch.ones(exponent.shape), exponent)[..., None])
    return out


def decode_nvfp4(w: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """``e2m1 * (e4m3(scale) * global_scale)`` of a tile, f32 ``[R, K]`` into ``out``."""
    codes = _nibbles(w.parts["qweight"])  # uint8 [R, K]
    torch.index_select(_E2M1, 0, codes.view(-1).long(), out=out.view(-1))
    block_scale = w.parts["scales"].view(torch.float8_e4m3fn).float() * w.parts["global_scale"]  # [R, G]
    _grouped(out, 16).mul_(block_scale[..., None])
    return out


#: format -> ``decode(tile QuantizedTensor [R, K], out f32 [R, K]) -> out``.
HF_DECODERS: dict[str, Callable[[QuantizedTensor, torch.Tensor], torch.Tensor]] = {
    "fp8_e4m3": decode_fp8_e4m3,
    "int4_g": decode_int_g,
    "int8_g": decode_int_g,
    "mxfp4": decode_mxfp4,
    "nvfp4": decode_nvfp4,
}
