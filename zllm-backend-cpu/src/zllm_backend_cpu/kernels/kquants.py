"""CPU row decoders for the GGUF k-quants ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``.

Dimension legend: ``R`` rows of a weight tile, ``K`` in-features (a multiple of 256),
``NB = K // 256`` super-blocks per row, ``S`` sub-blocks per super-block (16 or 8).

Each ``decode_*_rows(data, k, out)`` turns the bytes of ``R`` rows, uint8 ``[R, NB * type_size]``,
into f32 ``[R, K]`` (into ``out`` when given: the reused tile buffer of
:mod:`zllm_backend_cpu.kernels.linear`). Block layouts: ggml ``ggml-common.h``
(``block_q2_K`` …), summarised in ``zllm.weights.formats``. The f32 arithmetic is the
reference's (``zllm.domain.quant``, after gguf-py's ``Q*_K.dequantize_blocks``): sub-block
scale ``d * sc`` and min ``dmin * m`` rounded to f32, then ``(d * sc) * q`` and ``- dmin * m``
as separate, unfused operations, so decoded weights equal the reference bit for bit. Bit
fields are unpacked into a uint8 staging tile (a quarter of the f32 tile) and widened to
f32 by the multiply that applies the scale. q4_k/q5_k (whose 144/176-byte blocks are whole
int64 words) unpack nibbles eight bytes per int64 operation and their packed 6-bit scales
four per int32 operation: on a 2-core x86 box that made a 256 x 4096 q4_k tile decode
~2x faster than byte-wise unpacking.
"""

from __future__ import annotations

import torch

QK_K = 256  # weights per super-block
_SHIFTS_2BIT = (0, 2, 4, 6)
_SHIFTS_4BIT = (0, 4)
_SHIFTS_1BIT = tuple(range(8))


def _unpack(packed: torch.Tensor, shifts: tuple[int, ...], mask: int, out: torch.Tensor) -> torch.Tensor:
    """``out[..., i, :] = (packed >> shifts[i]) & mask``: uint8 ``[..., L]``
    -> ``out`` uint8 ``[..., len(shifts), L]``."""
    for i, s in enumerate(shifts):
        dst = out[..., i, :]
        if s == 0:
            torch.bitwise_and(packed, mask, out=dst)
        else:
            torch.bitwise_right_shift(packed, s, out=dst)
            if s + mask.bit_length() < 8:
                dst.bitwise_and_(mask)
    return out


def _f16(field: torch.Tensor) -> torch.Tensor:
    """A 2-byte f16 field uint8 ``[R, NB, 2]`` as f32 ``[R, NB, 1]`` (exact)."""
    return field.contiguous().view(torch.float16).float()


def _scale_min_k4(data: torch.Tensor, r: int, nb: int, words_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k/q5_k: sub-block scale ``d * sc`` and min ``dmin * m``, f32 ``[R, NB, 8, 1]`` each
    (ggml ``get_scale_min_k4``).

    The 12 scale bytes (block bytes 4..15) are read as three little-endian int32 words
    ``lo, mid, hi`` and unpacked four bytes at a time: scales 0-3 = ``lo & 63``, 4-7 =
    ``(hi & 15) | (lo >> 6) << 4``; mins 0-3 = ``mid & 63``, 4-7 = ``(hi >> 4) | (mid >> 6) << 4``.
    """
    words = data.view(torch.int32).view(r, nb, words_per_block)  # [R, NB, type_size / 4]
    lo, mid, hi = words[..., 1], words[..., 2], words[..., 3]  # [R, NB] each
    packed = torch.empty(r, nb, 4, dtype=torch.int32)  # bytes: scales 0-3, 4-7, mins 0-3, 4-7
    torch.bitwise_and(lo, 0x3F3F3F3F, out=packed[..., 0])
    torch.bitwise_or(hi & 0x0F0F0F0F, (lo >> 2) & 0x30303030, out=packed[..., 1])
    torch.bitwise_and(mid, 0x3F3F3F3F, out=packed[..., 2])
    torch.bitwise_or((hi >> 4) & 0x0F0F0F0F, (mid >> 2) & 0x30303030, out=packed[..., 3])
    sc_mn = packed.view(torch.uint8).view(r, nb, 2, 8).float()  # [R, NB, {scale, min}, 8]
    d_dmin = _f16(data.view(r, nb, words_per_block * 4)[..., :4].unflatten(-1, (2, 2)))  # [R, NB, 2, 1]
    dl_ml = (d_dmin * sc_mn).unsqueeze(-1)  # [R, NB, 2, 8, 1]
    return dl_ml[:, :, 0].contiguous(), dl_ml[:, :, 1].contiguous()  # contiguous: faster broadcasts


_NIBBLES = 0x0F0F0F0F0F0F0F0F  # low nibble of each byte of an int64 word
_BIT0 = 0x0101010101010101  # bit 0 of each byte


def _nibbles_q4_k(qs: torch.Tensor, r: int, nb: int) -> torch.Tensor:
    """128 qs bytes per super-block as int64 ``[R, NB, 16]`` -> uint8 ``[2, R, NB, 4, 32]``:
    ``[n, ..., g, l]`` is nibble ``n`` of byte ``32g + l``, i.e. weight ``64g + 32n + l``
    (sub-block ``2g + n``). Unpacked eight bytes per int64 operation."""
    nib = torch.empty(2, r, nb, 16, dtype=torch.int64)
    torch.bitwise_and(qs, _NIBBLES, out=nib[0])
    torch.bitwise_right_shift(qs, 4, out=nib[1]).bitwise_and_(_NIBBLES)
    return nib.view(torch.uint8).view(2, r, nb, 4, 32)


def _out(out: torch.Tensor | None, r: int, k: int) -> torch.Tensor:
    return torch.empty(r, k) if out is None else out


def decode_q2_k_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q2_k uint8 ``[R, NB * 84]`` -> f32 ``[R, K]``: ``w = d * (sc & 15) * q - dmin * (sc >> 4)`` per 16 weights."""
    r, nb = data.shape[0], k // QK_K
    blocks = data.view(r, nb, 84)  # [R, NB, 84]
    scales = blocks[..., :16]  # [R, NB, 16]
    dl = (_f16(blocks[..., 80:82]) * (scales & 0x0F).float()).unsqueeze(-1)  # [R, NB, 16, 1]
    ml = (_f16(blocks[..., 82:84]) * (scales >> 4).float()).unsqueeze(-1)  # [R, NB, 16, 1]
    q = torch.empty(r, nb, 2, 4, 32, dtype=torch.uint8)  # weight 128h + 32j + l
    _unpack(blocks[..., 16:80].view(r, nb, 2, 32), _SHIFTS_2BIT, 0x03, q)
    w = _out(out, r, k).view(r, nb, 16, 16)  # [R, NB, S=16, 16]
    torch.mul(q.view(r, nb, 16, 16), dl, out=w)
    return w.sub_(ml).view(r, k)


def decode_q3_k_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q3_k uint8 ``[R, NB * 110]`` -> f32 ``[R, K]``: ``w = d * (sc6 - 32) * q``, ``q = low2 + 4 * hbit - 4``."""
    r, nb = data.shape[0], k // QK_K
    blocks = data.view(r, nb, 110)  # [R, NB, 110]
    scales = blocks[..., 96:108]
    low = _unpack(scales[..., :8], _SHIFTS_4BIT, 0x0F, torch.empty(r, nb, 2, 8, dtype=torch.uint8))
    high = _unpack(scales[..., 8:], _SHIFTS_2BIT, 0x03, torch.empty(r, nb, 4, 4, dtype=torch.uint8))
    sc = (low.view(r, nb, 16) | (high.view(r, nb, 16) << 4)).to(torch.int8) - 32  # [R, NB, 16]
    dl = (_f16(blocks[..., 108:110]) * sc.float()).unsqueeze(-1)  # [R, NB, 16, 1]
    q = torch.empty(r, nb, 2, 4, 32, dtype=torch.uint8)  # low 2 bits of weight 128h + 32j + l
    _unpack(blocks[..., 32:96].view(r, nb, 2, 32), _SHIFTS_2BIT, 0x03, q)
    hbit = _unpack(blocks[..., :32], _SHIFTS_1BIT, 0x01, torch.empty(r, nb, 8, 32, dtype=torch.uint8))  # weight 32b + l
    q = q.view(r, nb, 8, 32).bitwise_or_(hbit.bitwise_left_shift_(2))  # q + 4 in [0, 7]
    w = _out(out, r, k).view(r, nb, 16, 16)
    w.copy_(q.view(r, nb, 16, 16)).sub_(4.0)  # exact integers
    return w.mul_(dl).view(r, k)


def decode_q4_k_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q4_k uint8 ``[R, NB * 144]`` -> f32 ``[R, K]``: ``w = d * sc * q - dmin * m`` per 32 weights."""
    r, nb = data.shape[0], k // QK_K
    dl, ml = _scale_min_k4(data, r, nb, 36)  # [R, NB, 8, 1]
    q = _nibbles_q4_k(data.view(torch.int64).view(r, nb, 18)[..., 2:], r, nb)  # [2, R, NB, 4, 32]
    w = _out(out, r, k).view(r, nb, 4, 2, 32)  # [R, NB, g, n, 32]: sub-block 2g + n
    dl = dl.view(r, nb, 4, 2, 1)
    for n in range(2):
        torch.mul(q[n], dl[..., n, :], out=w[..., n, :])  # widen to f32 while scaling
    return w.view(r, nb, 8, 32).sub_(ml).view(r, k)


def decode_q5_k_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q5_k uint8 ``[R, NB * 176]`` -> f32 ``[R, K]``: as q4_k with bit 4 of ``q`` from ``qh``."""
    r, nb = data.shape[0], k // QK_K
    dl, ml = _scale_min_k4(data, r, nb, 44)  # [R, NB, 8, 1]
    words = data.view(torch.int64).view(r, nb, 22)  # qh = words 2..5, qs = words 6..21
    q = _nibbles_q4_k(words[..., 6:], r, nb)  # [2, R, NB, 4, 32]
    qh = words[..., 2:6]  # [R, NB, 4]: byte l, bit b = bit 4 of weight 32b + l
    high = torch.empty(8, r, nb, 4, dtype=torch.int64)  # [b, R, NB, 4 words of 8 bytes]
    for b in range(8):
        torch.bitwise_right_shift(qh, b, out=high[b]).bitwise_and_(_BIT0).bitwise_left_shift_(4)
    high = high.view(torch.uint8).view(4, 2, r, nb, 32)  # [g, n, R, NB, l]: sub-block 2g + n
    w = _out(out, r, k).view(r, nb, 4, 2, 32)
    dl = dl.view(r, nb, 4, 2, 1)
    for n in range(2):
        qn = q[n].bitwise_or_(high[:, n].permute(1, 2, 0, 3))  # [R, NB, 4, 32] in [0, 31]
        torch.mul(qn, dl[..., n, :], out=w[..., n, :])
    return w.view(r, nb, 8, 32).sub_(ml).view(r, k)


def decode_q6_k_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q6_k uint8 ``[R, NB * 210]`` -> f32 ``[R, K]``: ``w = d * sc * (q - 32)`` per 16 weights."""
    r, nb = data.shape[0], k // QK_K
    blocks = data.view(r, nb, 210)  # [R, NB, 210]
    dl = (_f16(blocks[..., 208:210]) * blocks[..., 192:208].view(torch.int8).float()).unsqueeze(-1)  # [R, NB, 16, 1]
    low = torch.empty(r, nb, 2, 2, 64, dtype=torch.uint8)  # half h, nibble n, byte b: weight 128h + 64n + b
    _unpack(blocks[..., :128].view(r, nb, 2, 64), _SHIFTS_4BIT, 0x0F, low)
    high = torch.empty(r, nb, 2, 4, 32, dtype=torch.uint8)  # half h, bit pair j, l: weight 128h + 32j + l
    _unpack(blocks[..., 128:192].view(r, nb, 2, 32), _SHIFTS_2BIT, 0x03, high)
    q = low.view(r, nb, 2, 4, 32).bitwise_or_(high.bitwise_left_shift_(4))  # q + 32 in [0, 63]
    w = _out(out, r, k).view(r, nb, 16, 16)
    w.copy_(q.view(r, nb, 16, 16)).sub_(32.0)  # exact integers
    return w.mul_(dl).view(r, k)


#: format -> row decoder, for :mod:`zllm_backend_cpu.kernels.linear`.
KQUANT_DECODERS = {
    "q2_k": decode_q2_k_rows,
    "q3_k": decode_q3_k_rows,
    "q4_k": decode_q4_k_rows,
    "q5_k": decode_q5_k_rows,
    "q6_k": decode_q6_k_rows,
}
