"""Weight formats: the names zllm uses for dense dtypes and quantized block layouts.

A *format* is the storage of one weight tensor: a dense torch dtype (``f32``, ``f16``,
``bf16``) or a GGUF block-quantized layout (``q8_0``, ``q4_0``). Block layouts follow
ggml (``ggml/src/ggml-common.h``):

- ``q8_0``: 32 weights per block, 34 bytes = f16 scale ``d`` + 32 x int8 ``qs``;
  ``w[i] = d * qs[i]``.
- ``q4_0``: 32 weights per block, 18 bytes = f16 scale ``d`` + 16 bytes ``qs``; byte ``j``
  holds weight ``j`` in its low nibble and weight ``j + 16`` in its high nibble;
  ``w = d * (nibble - 8)``.
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


BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "q8_0": BlockLayout("q8_0", 32, 34),
    "q4_0": BlockLayout("q4_0", 32, 18),
}

ALL_FORMATS: tuple[str, ...] = ("f32", "f16", "bf16", *BLOCK_LAYOUTS)


def format_of(weight: "torch.Tensor | QuantizedTensor") -> str:
    """The format name of a weight: ``f32``/``f16``/``bf16`` or its block layout name.

    Raises:
        ValueError: a dense tensor of a dtype zllm does not store weights in.
    """
    if isinstance(weight, QuantizedTensor):
        return weight.fmt
    try:
        return DENSE_FORMATS[weight.dtype]
    except KeyError:
        raise ValueError(f"unsupported weight dtype {weight.dtype}; expected one of {sorted(DENSE_FORMATS.values())}") from None


@attrs.frozen(eq=False)
class QuantizedTensor:
    """A block-quantized 2-D weight kept in its stored bytes.

    Attributes:
        data: uint8 ``[rows, cols // block_size * type_size]``; row ``r`` holds the blocks of
            logical row ``r`` in order (ggml's layout), so a row permutation is a permutation
            of ``data``'s rows.
        fmt: block layout name, a key of :data:`BLOCK_LAYOUTS`.
        shape: logical ``(rows, cols)`` of the dequantized tensor; ``cols`` is a multiple of
            the block size.
    """

    data: torch.Tensor
    fmt: str
    shape: tuple[int, int]

    def __attrs_post_init__(self) -> None:
        layout = BLOCK_LAYOUTS[self.fmt]
        rows, cols = self.shape
        assert cols % layout.block_size == 0, (self.fmt, self.shape)
        assert self.data.dtype == torch.uint8
        assert tuple(self.data.shape) == (rows, cols // layout.block_size * layout.type_size), (
            tuple(self.data.shape),
            self.shape,
        )

    @property
    def layout(self) -> BlockLayout:
        return BLOCK_LAYOUTS[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The rows ``index`` (int64 ``[n]``) as a new quantized tensor of shape ``(n, cols)``."""
        return QuantizedTensor(self.data[index], self.fmt, (int(index.numel()), self.shape[1]))

    def to(self, device: torch.device) -> "QuantizedTensor":
        return QuantizedTensor(self.data.to(device), self.fmt, self.shape)
