"""Weight formats: the names zllm uses for dense dtypes and quantized block layouts.

A *format* is the storage of one weight tensor: a dense torch dtype (``f32``, ``f16``,
``bf16``) or a GGUF block-quantized layout (``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``,
the k-quants ``q2_k`` … ``q6_k``). Block layouts follow ggml (``ggml/src/ggml-common.h``);
all multi-byte fields are little endian:

- ``q8_0``: 32 weights per block, 34 bytes = f16 scale ``d`` + 32 x int8 ``qs``;
  ``w[i] = d * qs[i]``.
- ``q4_0``: 32 weights per block, 18 bytes = f16 scale ``d`` + 16 bytes ``qs``; byte ``j``
  holds weight ``j`` in its low nibble and weight ``j + 16`` in its high nibble;
  ``w = d * (nibble - 8)``.
- ``q4_1``: 32 weights per block, 20 bytes = f16 scale ``d`` + f16 min ``m`` + 16 bytes
  ``qs`` (nibbles placed as in ``q4_0``); ``w = d * nibble + m``.
- ``q5_0``: 32 weights per block, 22 bytes = f16 ``d`` + ``qh[4]`` (one little-endian
  uint32) + 16 bytes ``qs`` (low 4 bits, placed as in ``q4_0``); bit ``i`` of ``qh`` is bit 4
  of weight ``i``'s ``q``; ``w = d * (q - 16)``.
- ``q5_1``: 32 weights per block, 24 bytes = f16 ``d`` + f16 ``m`` + ``qh[4]`` + 16 bytes
  ``qs`` (``q`` as in ``q5_0``); ``w = d * q + m``.

Rows whose length is not a multiple of 256 cannot hold k-quant super-blocks, so llama.cpp's
``Q4_K_M``/``Q5_K_M`` files store such tensors (e.g. MoE expert widths of 1408) in these
32-weight formats.

K-quants (``block_q*_K``) use a *super-block* of ``QK_K = 256`` weights split into
sub-blocks (16 of 16 weights or 8 of 32), each with its own small integer scale (and min)
that multiplies the super-block's f16 ``d`` (and ``dmin``). ``sub(i)`` below is the sub-block
of weight ``i``; ``q`` is the weight's quantized integer:

- ``q2_k``: 84 bytes = ``scales[16]`` (byte ``s``: low nibble = scale, high nibble = min of
  sub-block ``s`` of 16 weights) + ``qs[64]`` (2-bit ``q``) + f16 ``d`` + f16 ``dmin``.
  Weights ``128*h + 32*j + l`` (half ``h``, ``j`` in 0..3, ``l`` in 0..31) sit in bits
  ``2j, 2j+1`` of ``qs[32*h + l]``. ``w = d * scale * q - dmin * min``.
- ``q3_k``: 110 bytes = ``hmask[32]`` + ``qs[64]`` (low 2 bits, placed as in ``q2_k``) +
  ``scales[12]`` (16 6-bit scales: low nibbles in bytes 0..7 — sub-block ``s < 8`` in byte
  ``s``'s low nibble, ``s >= 8`` in byte ``s - 8``'s high nibble — high 2 bits in bytes
  8..11, sub-block ``s`` at bits ``2*(s // 4)`` of byte ``8 + s % 4``) + f16 ``d``. Bit
  ``i // 32`` of ``hmask[i % 32]`` is the high bit; ``q = low2 - (0 if high else 4)`` in
  ``[-4, 3]``. ``w = d * (scale6 - 32) * q``.
- ``q4_k``: 144 bytes = f16 ``d`` + f16 ``dmin`` + ``scales[12]`` (8 6-bit scales and 8
  6-bit mins, packed as ggml's ``get_scale_min_k4``: for ``s < 4`` scale = ``b[s] & 63``,
  min = ``b[s+4] & 63``; for ``s >= 4`` scale = ``(b[s+4] & 15) | (b[s-4] >> 6) << 4``,
  min = ``(b[s+4] >> 4) | (b[s] >> 6) << 4``) + ``qs[128]``. Weights ``64*g + l`` and
  ``64*g + 32 + l`` (``g`` in 0..3, ``l`` in 0..31) are the low and high nibble of
  ``qs[32*g + l]``; sub-blocks of 32. ``w = d * scale * q - dmin * min``.
- ``q5_k``: 176 bytes = f16 ``d`` + f16 ``dmin`` + ``scales[12]`` (as ``q4_k``) + ``qh[32]``
  + ``qs[128]`` (low 4 bits, as ``q4_k``). Bit ``i // 32`` of ``qh[i % 32]`` is bit 4 of
  ``q``. ``w = d * scale * q - dmin * min``.
- ``q6_k``: 210 bytes = ``ql[128]`` + ``qh[64]`` + int8 ``scales[16]`` + f16 ``d``. In half
  ``h`` (weights ``128*h ..``), for ``l`` in 0..31, weights ``+l``, ``+l+32``, ``+l+64``,
  ``+l+96`` take their low 4 bits from ``ql[64h+l] & 15``, ``ql[64h+l+32] & 15``,
  ``ql[64h+l] >> 4``, ``ql[64h+l+32] >> 4`` and their high 2 bits from bits 0-1, 2-3, 4-5,
  6-7 of ``qh[32h+l]``; sub-blocks of 16. ``w = d * scale * (q - 32)``.
"""

from __future__ import annotations

import attrs
import torch

DENSE_FORMATS: dict[torch.dtype, str] = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DTYPE_OF_FORMAT: dict[str, torch.dtype] = {v: k for k, v in DENSE_FORMATS.items()}


@attrs.frozen
class BlockLayout:
    """One quantized block layout: ``block_size`` weights stored in ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int


QK_K = 256  # weights per k-quant super-block (ggml's QK_K)

BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "q8_0": BlockLayout("q8_0", 32, 34),
    "q4_0": BlockLayout("q4_0", 32, 18),
    "q4_1": BlockLayout("q4_1", 32, 20),  # 2 + 2 + 16
    "q5_0": BlockLayout("q5_0", 32, 22),  # 2 + 4 + 16
    "q5_1": BlockLayout("q5_1", 32, 24),  # 2 + 2 + 4 + 16
    "q2_k": BlockLayout("q2_k", QK_K, 84),  # 16 + 64 + 2 + 2
    "q3_k": BlockLayout("q3_k", QK_K, 110),  # 32 + 64 + 12 + 2
    "q4_k": BlockLayout("q4_k", QK_K, 144),  # 2 + 2 + 12 + 128
    "q5_k": BlockLayout("q5_k", QK_K, 176),  # 2 + 2 + 12 + 32 + 128
    "q6_k": BlockLayout("q6_k", QK_K, 210),  # 128 + 64 + 16 + 2
}

ALL_FORMATS: tuple[str, ...] = ("f32", "f16", "bf16", *BLOCK_LAYOUTS)


def format_of(weight: torch.Tensor | QuantizedTensor) -> str:
    """The format name of a weight: ``f32``/``f16``/``bf16`` or its block layout name.

    Raises:
        ValueError: a dense tensor of a dtype zllm does not store weights in.
    """
    if isinstance(weight, QuantizedTensor):
        return weight.fmt
    try:
        return DENSE_FORMATS[weight.dtype]
    except KeyError:
        raise ValueError(
            f"unsupported weight dtype {weight.dtype}; expected one of {sorted(DENSE_FORMATS.values())}"
        ) from None


@attrs.frozen(eq=False)
class QuantizedTensor:
    """A block-quantized weight kept in its stored bytes: 2-D ``[N, K]``, or N-D with leading
    dimensions (an expert stack ``[E, N, K]``) over the same per-row blocks.

    Attributes:
        data: uint8 ``[*lead, rows, cols // block_size * type_size]``; row ``r`` holds the
            blocks of logical row ``r`` in order (ggml's layout), so a row permutation is a
            permutation of ``data``'s rows.
        fmt: block layout name, a key of :data:`BLOCK_LAYOUTS`.
        shape: logical ``(*lead, rows, cols)`` of the dequantized tensor; ``cols`` is a
            multiple of the block size.
    """

    data: torch.Tensor
    fmt: str
    shape: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        layout = BLOCK_LAYOUTS[self.fmt]
        *lead, cols = self.shape
        assert len(self.shape) >= 2 and cols % layout.block_size == 0, (self.fmt, self.shape)
        assert self.data.dtype == torch.uint8
        assert tuple(self.data.shape) == (*lead, cols // layout.block_size * layout.type_size), (
            tuple(self.data.shape),
            self.shape,
        )

    @property
    def layout(self) -> BlockLayout:
        return BLOCK_LAYOUTS[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __getitem__(self, index: int) -> QuantizedTensor:
        """Slice ``index`` of the first dimension (expert ``e`` of ``[E, N, K]`` -> ``[N, K]``),
        sharing ``data``. Only N-D (N >= 3) tensors slice; a 2-D weight's rows come from
        :meth:`rows`.

        Raises:
            IndexError: ``index`` is outside ``[-shape[0], shape[0])``.
        """
        assert len(self.shape) >= 3 and isinstance(index, int), (self.shape, index)
        if not -self.shape[0] <= index < self.shape[0]:
            raise IndexError(f"index {index} out of range for the first dimension of "
                             f"{list(self.shape)}")
        return QuantizedTensor(self.data[index], self.fmt, self.shape[1:])

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows ``index`` (int64 ``[n]``) of a 2-D tensor as a new quantized tensor of
        shape ``(n, cols)``."""
        assert len(self.shape) == 2, self.shape
        return QuantizedTensor(self.data[index], self.fmt, (int(index.numel()), self.shape[1]))

    def to(self, device: torch.device) -> QuantizedTensor:
        return QuantizedTensor(self.data.to(device), self.fmt, self.shape)
