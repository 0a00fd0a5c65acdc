"""f32 reference dequantization of GGUF block-quantized weights.

Dimension legend: ``R`` rows, ``C`` logical columns, ``NBK = C // 32`` blocks per row,
``QK = 32`` weights per block.

Block layouts follow ggml ``ggml/src/ggml-common.h`` (``block_q8_0``, ``block_q4_0``) and
the ``gguf`` Python package (``gguf/quants.py``, ``Q8_0`` / ``Q4_0.dequantize_blocks``),
whose results these functions reproduce bit for bit (NaN/inf scales included):

- ``q8_0``: 34 bytes = f16 scale ``d`` (little endian) + 32 x int8 ``qs``;
  ``w[i] = d * qs[i]``.
- ``q4_0``: 18 bytes = f16 scale ``d`` + 16 bytes ``qs``; byte ``j`` holds weight ``j`` in
  its low nibble and weight ``j + 16`` in its high nibble; ``w = d * (nibble - 8)``.
"""

from __future__ import annotations

import torch

from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor

QK = 32  # weights per block for q8_0 and q4_0


def _blocks(w: QuantizedTensor) -> torch.Tensor:
    """The raw bytes of ``w`` viewed block by block: uint8 ``[R, NBK, type_size]``."""
    rows, cols = w.shape
    layout = w.layout
    assert layout.block_size == QK, layout
    return w.data.contiguous().view(rows, cols // QK, layout.type_size)  # [R, NBK, type_size]


def dequantize_q8_0(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q8_0`` tensor to f32 ``[R, C]``.

    Raises:
        AssertionError: ``w`` is not ``q8_0``.
    """
    assert w.fmt == "q8_0", w.fmt
    rows, cols = w.shape
    blocks = _blocks(w)  # [R, NBK, 34]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()  # [R, NBK, 32]
    return (qs * d).reshape(rows, cols)  # [R, C]


def dequantize_q4_0(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize a ``q4_0`` tensor to f32 ``[R, C]``.

    Raises:
        AssertionError: ``w`` is not ``q4_0``.
    """
    assert w.fmt == "q4_0", w.fmt
    rows, cols = w.shape
    blocks = _blocks(w)  # [R, NBK, 18]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:]  # [R, NBK, 16]
    low = qs & 0x0F  # weights 0..15 of the block
    high = qs >> 4  # weights 16..31 of the block
    nibbles = torch.cat([low, high], dim=-1)  # [R, NBK, 32]
    q = nibbles.to(torch.int8) - 8  # in [-8, 7]
    return (q.float() * d).reshape(rows, cols)  # [R, C]


_DEQUANTIZERS = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0}
assert set(_DEQUANTIZERS) == set(BLOCK_LAYOUTS), "every block layout needs a reference dequantizer"


def dequantize(w: QuantizedTensor) -> torch.Tensor:
    """Dequantize any supported block layout to f32 ``[R, C]``.

    Raises:
        ValueError: ``w.fmt`` has no dequantizer (names the valid ones).
    """
    try:
        fn = _DEQUANTIZERS[w.fmt]
    except KeyError:
        raise ValueError(f"no reference dequantizer for format {w.fmt!r}; expected one of {sorted(_DEQUANTIZERS)}") from None
    return fn(w)
