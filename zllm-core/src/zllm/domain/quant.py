"""f32 reference dequantization of GGUF block-quantized weights.

Dimension legend: ``E`` leading dimensions of an N-D weight (experts), ``R`` rows (all
leading dimensions flattened), ``C`` logical columns, ``NBK = C // block_size`` blocks per
row, ``QK = 32`` weights per q8_0/q4_0/q4_1/q5_0/q5_1 block, ``QK_K = 256`` weights per
k-quant super-block, ``S`` sub-blocks per super-block (16 or 8).

Every function takes a 2-D ``[R, C]`` or N-D ``[E, R, C]`` :class:`QuantizedTensor` and
returns f32 of its logical shape. Blocks never cross a row, so an N-D weight decodes as its
rows flattened: expert slice ``w[e]`` decodes to ``dequantize(w)[e]``, as gguf-py's
``dequantize`` does for numpy ``[E, N, bytes]``.

Block layouts follow ggml ``ggml/src/ggml-common.h`` (``block_q8_0``, ``block_q4_0``,
``block_q4_1``, ``block_q5_0``, ``block_q5_1``) and the ``gguf`` Python package
(``gguf/quants.py``, ``Q8_0`` … ``Q5_1.dequantize_blocks``), whose results these functions
reproduce bit for bit (NaN/inf scales included):

- ``q8_0``: 34 bytes = f16 scale ``d`` (little endian) + 32 x int8 ``qs``;
  ``w[i] = d * qs[i]``.
- ``q4_0``: 18 bytes = f16 scale ``d`` + 16 bytes ``qs``; byte ``j`` holds weight ``j`` in
  its low nibble and weight ``j + 16`` in its high nibble; ``w = d * (nibble - 8)``.
- ``q4_1``: 20 bytes = f16 ``d`` + f16 min ``m`` + 16 bytes ``qs`` (as ``q4_0``);
  ``w = (d * nibble) + m``, rounded after the product and again after the sum (gguf-py's
  order; never fused).
- ``q5_0``: 22 bytes = f16 ``d`` + ``qh`` (little-endian uint32) + 16 bytes ``qs`` (as
  ``q4_0``); bit ``i`` of ``qh`` is bit 4 of weight ``i``; ``w = d * (q - 16)``.
- ``q5_1``: 24 bytes = f16 ``d`` + f16 ``m`` + ``qh`` + ``qs`` (``q`` as ``q5_0``);
  ``w = (d * q) + m``, as ``q4_1``.

The k-quants (``q2_k`` … ``q6_k``, layouts in :mod:`zllm.weights.formats`) follow ggml's
``dequantize_row_q2_K`` … ``dequantize_row_q6_K`` (``ggml/src/ggml-quants.c``) and gguf-py's
``Q2_K`` … ``Q6_K.dequantize_blocks``. The f32 operations are gguf-py's, in its order: the
sub-block scale ``d * sc`` (and min ``dmin * m``) is rounded to f32 first, then
``(d * sc) * q`` and ``- dmin * m`` — never fused.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch

from zllm.weights.formats import FORMATS, QuantizedTensor

QK = 32  # weights per block for q8_0, q4_0, q4_1, q5_0 and q5_1


def _rows_cols(w: QuantizedTensor) -> tuple[int, int]:
    """``(R, C)``: the rows of ``w`` with every leading dimension flattened, and its columns."""
    return math.prod(w.shape[:-1]), w.shape[-1]


def _blocks(w: QuantizedTensor) -> torch.Tensor:
    """The raw bytes of ``w`` viewed block by block: uint8 ``[R, NBK, type_size]``."""
    rows, cols = _rows_cols(w)
    layout = w.layout
    return w.data.contiguous().view(rows, cols // layout.block_size, layout.type_size)  # [R, NBK, type_size]


def _f16(field: torch.Tensor) -> torch.Tensor:
    """A 2-byte little-endian f16 field uint8 ``[..., 2]`` as f32 ``[..., 1]`` (exact)."""
    return field.contiguous().view(torch.float16).float()


def _bits(packed: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``(packed >> shift) & mask`` for each shift: uint8 ``[..., L]`` -> ``[..., len(shifts), L]``."""
    return torch.stack([(packed >> s) & mask for s in shifts], dim=-2)


def unpack_scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and 8 6-bit mins of a q4_k/q5_k super-block: uint8 ``[..., 12]`` -> 2 x ``[..., 8]``.

    ggml ``get_scale_min_k4``; with ``b`` the 12 bytes, ``s < 4``: scale ``b[s] & 63``, min
    ``b[s+4] & 63``; ``s >= 4``: scale ``(b[s+4] & 15) | (b[s-4] >> 6) << 4``, min
    ``(b[s+4] >> 4) | (b[s] >> 6) << 4``.
    """
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]  # each [..., 4]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # [..., 8]
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [..., 8]
    return sc, mn


def unpack_scales_q3_k(scales: torch.Tensor) -> torch.Tensor:
    """The 16 6-bit scales of a q3_k super-block, minus 32: uint8 ``[..., 12]`` -> int8 ``[..., 16]`` in ``[-32, 31]``.

    Low nibbles: bytes 0..7 (sub-block ``s < 8`` low nibble of byte ``s``, ``s >= 8`` high
    nibble of byte ``s - 8``); high 2 bits: bits ``2 * (s // 4)`` of byte ``8 + s % 4``.
    """
    low = _bits(scales[..., :8], (0, 4), 0x0F).flatten(-2)  # [..., 16]
    high = _bits(scales[..., 8:], (0, 2, 4, 6), 0x03).flatten(-2)  # [..., 16]
    return (low | (high << 4)).to(torch.int8) - 32


def dequantize_q8_0(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q8_0`` tensor to f32 of its shape (``[R, C]`` or ``[E, R, C]``).

    Raises:
        AssertionError: ``w`` is not ``q8_0``.
    """
    assert w.fmt == "q8_0", w.fmt
    blocks = _blocks(w)  # [R, NBK, 34]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()  # [R, NBK, 32]
    return (qs * d).reshape(w.shape)  # [R, C] or [E, R, C]


def dequantize_q4_0(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q4_0`` tensor to f32 of its shape (``[R, C]`` or ``[E, R, C]``).

    Raises:
        AssertionError: ``w`` is not ``q4_0``.
    """
    assert w.fmt == "q4_0", w.fmt
    blocks = _blocks(w)  # [R, NBK, 18]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:]  # [R, NBK, 16]
    low = qs & 0x0F  # weights 0..15 of the block
    high = qs >> 4  # weights 16..31 of the block
    nibbles = torch.cat([low, high], dim=-1)  # [R, NBK, 32]
    q = nibbles.to(torch.int8) - 8  # in [-8, 7]
    return (q.float() * d).reshape(w.shape)  # [R, C] or [E, R, C]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 ``qs`` bytes of a 32-weight block, uint8 ``[..., 16]`` -> ``[..., 32]``: low nibbles
    (weights 0..15), then high nibbles (weights 16..31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits_q5(qh: torch.Tensor) -> torch.Tensor:
    """The 4 ``qh`` bytes of a q5_0/q5_1 block, uint8 ``[..., 4]`` (one little-endian uint32)
    -> bit 4 of each weight's ``q``, uint8 ``[..., 32]`` in ``{0, 16}``; bit ``i`` is weight
    ``i``'s."""
    bits = _bits(qh, tuple(range(8)), 0x01)  # [..., 8, 4]: bit b of byte j is weight 8j + b
    return bits.transpose(-1, -2).flatten(-2) << 4  # [..., 32]


def dequantize_q4_1(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q4_1`` tensor to f32 of its shape (ggml ``dequantize_row_q4_1``).

    Raises:
        AssertionError: ``w`` is not ``q4_1``.
    """
    assert w.fmt == "q4_1", w.fmt
    blocks = _blocks(w)  # [R, NBK, 20]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [R, NBK, 1] each
    q = _nibbles(blocks[..., 4:]).float()  # [R, NBK, 32] in [0, 15]
    return (d * q + m).reshape(w.shape)  # two roundings: the product, then the sum


def dequantize_q5_0(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q5_0`` tensor to f32 of its shape (ggml ``dequantize_row_q5_0``).

    Raises:
        AssertionError: ``w`` is not ``q5_0``.
    """
    assert w.fmt == "q5_0", w.fmt
    blocks = _blocks(w)  # [R, NBK, 22]
    d = _f16(blocks[..., 0:2])  # [R, NBK, 1]
    q = _nibbles(blocks[..., 6:]) | _high_bits_q5(blocks[..., 2:6])  # [R, NBK, 32] in [0, 31]
    return (d * (q.to(torch.int8) - 16).float()).reshape(w.shape)


def dequantize_q5_1(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q5_1`` tensor to f32 of its shape (ggml ``dequantize_row_q5_1``).

    Raises:
        AssertionError: ``w`` is not ``q5_1``.
    """
    assert w.fmt == "q5_1", w.fmt
    blocks = _blocks(w)  # [R, NBK, 24]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [R, NBK, 1] each
    q = _nibbles(blocks[..., 8:]) | _high_bits_q5(blocks[..., 4:8])  # [R, NBK, 32] in [0, 31]
    q = q.float()
    return (d * q + m).reshape(w.shape)  # two roundings, as q4_1


def dequantize_q2_k(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q2_k`` tensor to f32 of its shape (ggml ``dequantize_row_q2_K``).

    Raises:
        AssertionError: ``w`` is not ``q2_k``.
    """
    assert w.fmt == "q2_k", w.fmt
    rows, _ = _rows_cols(w)
    blocks = _blocks(w)  # [R, NBK, 84]
    scales, qs = blocks[..., :16], blocks[..., 16:80]  # [R, NBK, 16], [R, NBK, 64]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])  # [R, NBK, 1] each
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # [R, NBK, 16, 1]: scale of each 16-weight sub-block
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)  # [R, NBK, 16, 1]: its min
    halves = qs.unflatten(-1, (2, 32))  # [R, NBK, 2, 32]: 32 bytes per 128 weights
    q = _bits(halves, (0, 2, 4, 6), 0x03)  # [R, NBK, 2, 4, 32]: weight 128h + 32j + l
    q = q.reshape(rows, -1, 16, 16).float()  # [R, NBK, S=16, 16]
    return (dl * q - ml).reshape(w.shape)  # [R, C] or [E, R, C]


def dequantize_q3_k(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q3_k`` tensor to f32 of its shape (ggml ``dequantize_row_q3_K``).

    Raises:
        AssertionError: ``w`` is not ``q3_k``.
    """
    assert w.fmt == "q3_k", w.fmt
    rows, _ = _rows_cols(w)
    blocks = _blocks(w)  # [R, NBK, 110]
    hmask, qs, scales = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])  # [R, NBK, 1]
    dl = (d * unpack_scales_q3_k(scales).float()).unsqueeze(-1)  # [R, NBK, 16, 1]
    low = _bits(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 0x03)  # [R, NBK, 2, 4, 32]: weight 128h + 32j + l
    high = _bits(hmask, tuple(range(8)), 0x01)  # [R, NBK, 8, 32]: weight 32b + l
    # a set hmask bit means "no offset": q = low - 4 * (1 - high), in [-4, 3]
    q = low.reshape(rows, -1, 16, 16).to(torch.int8) - ((high ^ 1) << 2).reshape(rows, -1, 16, 16).to(torch.int8)
    return (dl * q.float()).reshape(w.shape)  # [R, C] or [E, R, C]


def _dequantize_q4_k_like(w: QuantizedTensor, q: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``d * scale * q - dmin * min`` per 32-weight sub-block, ``q`` uint8 ``[R, NBK, 8, 32]``,
    ``head`` the first 16 bytes."""
    d, dmin = _f16(head[..., 0:2]), _f16(head[..., 2:4])  # [R, NBK, 1] each
    sc, mn = unpack_scale_min_k4(head[..., 4:16])  # [R, NBK, 8] each
    dl = (d * sc.float()).unsqueeze(-1)  # [R, NBK, 8, 1]
    ml = (dmin * mn.float()).unsqueeze(-1)  # [R, NBK, 8, 1]
    return (dl * q.float() - ml).reshape(w.shape)  # [R, C] or [E, R, C]


def dequantize_q4_k(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q4_k`` tensor to f32 of its shape (ggml ``dequantize_row_q4_K``).

    Raises:
        AssertionError: ``w`` is not ``q4_k``.
    """
    assert w.fmt == "q4_k", w.fmt
    rows, _ = _rows_cols(w)
    blocks = _blocks(w)  # [R, NBK, 144]
    qs = blocks[..., 16:].unflatten(-1, (4, 32))  # [R, NBK, 4, 32]: 32 bytes per 64 weights
    q = _bits(qs, (0, 4), 0x0F).reshape(rows, -1, 8, 32)  # [R, NBK, 8, 32]: low nibbles, then high
    return _dequantize_q4_k_like(w, q, blocks[..., :16])


def dequantize_q5_k(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q5_k`` tensor to f32 of its shape (ggml ``dequantize_row_q5_K``).

    Raises:
        AssertionError: ``w`` is not ``q5_k``.
    """
    assert w.fmt == "q5_k", w.fmt
    rows, _ = _rows_cols(w)
    blocks = _blocks(w)  # [R, NBK, 176]
    qh, qs = blocks[..., 16:48], blocks[..., 48:]  # [R, NBK, 32], [R, NBK, 128]
    low = _bits(qs.unflatten(-1, (4, 32)), (0, 4), 0x0F).reshape(rows, -1, 8, 32)  # [R, NBK, 8, 32]
    high = _bits(qh, tuple(range(8)), 0x01)  # [R, NBK, 8, 32]: bit 4 of weight 32b + l
    return _dequantize_q4_k_like(w, low | (high << 4), blocks[..., :16])


def dequantize_q6_k(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q6_k`` tensor to f32 of its shape (ggml ``dequantize_row_q6_K``).

    Raises:
        AssertionError: ``w`` is not ``q6_k``.
    """
    assert w.fmt == "q6_k", w.fmt
    rows, _ = _rows_cols(w)
    blocks = _blocks(w)  # [R, NBK, 210]
    ql, qh = blocks[..., :128], blocks[..., 128:192]  # [R, NBK, 128], [R, NBK, 64]
    scales = blocks[..., 192:208].view(torch.int8)  # [R, NBK, 16]
    d = _f16(blocks[..., 208:210])  # [R, NBK, 1]
    dl = (d * scales.float()).unsqueeze(-1)  # [R, NBK, 16, 1]
    low = _bits(ql.unflatten(-1, (2, 64)), (0, 4), 0x0F)  # [R, NBK, 2, 2, 64]: half h, nibble, byte
    high = _bits(qh.unflatten(-1, (2, 32)), (0, 2, 4, 6), 0x03)  # [R, NBK, 2, 4, 32]: half h, bit pair j, l
    q = low.reshape(rows, -1, 2, 4, 32) | (high << 4)  # weight 128h + 32j + l in [0, 63]
    q = q.reshape(rows, -1, 16, 16).to(torch.int8) - 32  # [R, NBK, S=16, 16] in [-32, 31]
    return (dl * q.float()).reshape(w.shape)  # [R, C] or [E, R, C]


def dequantize(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a weight of any registered format to f32 of ``w``'s shape (``[R, C]``, or
    ``[E, R, C]`` whose slice ``e`` is ``dequantize(w[e])``): the format's reference decode
    named in :data:`zllm.weights.formats.FORMATS`.

    Raises:
        ValueError: ``w.fmt`` is not a registered format (names the valid ones).
    """
    try:
        spec = FORMATS[w.fmt]
    except KeyError:
        raise ValueError(f"no reference dequantizer for format {w.fmt!r}; expected one of {sorted(FORMATS)}") from None
    module, _, function = spec.reference.partition(":")
    fn: Callable[[QuantizedTensor], torch.Tensor] = getattr(importlib.import_module(module), function)
    return fn(w)
