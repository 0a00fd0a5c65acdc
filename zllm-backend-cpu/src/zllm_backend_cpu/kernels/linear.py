"""CPU kernels for ``linear`` and ``embedding`` over dense (f32/f16/bf16) and GGUF q8_0/q4_0 weights.

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``R`` rows of a tile,
``NBK = K // 32`` blocks per row.

Low-precision and quantized weights are never expanded whole: rows are converted to f32 one
tile at a time (a working set of about :data:`TILE_BYTES`) and multiplied into the matching
slice of the output. Block layouts: ggml ``ggml-common.h`` (see ``zllm.weights.formats``);
the decode is the same arithmetic as the f32 reference (``zllm.domain.quant``), so the
results differ from it only by matmul summation order.
"""

from __future__ import annotations

import torch

from ._api import QuantizedTensor

TILE_BYTES = 4 << 20  # f32 working set of one decoded weight tile
QK = 32  # weights per q8_0 / q4_0 block


def _tile_rows(k: int) -> int:
    """Rows per tile so that one f32 tile of ``[R, K]`` is about TILE_BYTES (at least 16)."""
    return max(16, TILE_BYTES // (4 * k))


def decode_q8_0_rows(data: torch.Tensor, k: int) -> torch.Tensor:
    """Decode q8_0 bytes uint8 ``[R, NBK * 34]`` to f32 ``[R, K]`` (``w = d * qs``)."""
    r = data.shape[0]
    blocks = data.view(r, k // QK, 34)  # [R, NBK, 34]
    d = blocks[..., :2].view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:].view(torch.int8).float()  # [R, NBK, 32]
    return qs.mul_(d).view(r, k)  # [R, K]


def decode_q4_0_rows(data: torch.Tensor, k: int) -> torch.Tensor:
    """Decode q4_0 bytes uint8 ``[R, NBK * 18]`` to f32 ``[R, K]`` (``w = d * (nibble - 8)``; low nibbles first)."""
    r = data.shape[0]
    blocks = data.view(r, k // QK, 18)  # [R, NBK, 18]
    d = blocks[..., :2].view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:]  # [R, NBK, 16]
    q = torch.empty(r, k // QK, QK, dtype=torch.float32)  # [R, NBK, 32]
    q[..., :16] = qs & 0x0F
    q[..., 16:] = qs >> 4
    return q.sub_(8.0).mul_(d).view(r, k)  # [R, K]


def _decode_rows(weight: torch.Tensor | QuantizedTensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``weight`` as f32 ``[R, K]``."""
    if isinstance(weight, QuantizedTensor):
        k = weight.shape[1]
        data = weight.data[start:stop]
        if weight.fmt == "q8_0":
            return decode_q8_0_rows(data, k)
        if weight.fmt == "q4_0":
            return decode_q4_0_rows(data, k)
        raise ValueError(f"CPU linear kernel has no decoder for format {weight.fmt!r}; expected 'q8_0' or 'q4_0'")
    return weight[start:stop].float()


def _check(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> tuple[int, int]:
    n, k = weight.shape
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, weight.shape)
    assert bias is None or tuple(bias.shape) == (n,), (None if bias is None else bias.shape, n)
    return n, k


def _linear_tiled(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = _check(x, weight, bias)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)  # [T, N]
    rows = _tile_rows(k)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = _decode_rows(weight, start, stop)  # [R, K]
        out[:, start:stop] = x @ w.t()  # [T, R]
    if bias is not None:
        out += bias.float()
    return out


def linear_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for a dense f32/f16/bf16 ``weight [N, K]``; ``x`` f32 ``[T, K]`` -> f32 ``[T, N]``.

    f32 weights go straight to ``torch.nn.functional.linear``; f16/bf16 are upcast per row tile.
    """
    if weight.dtype == torch.float32:
        _check(x, weight, bias)
        return torch.nn.functional.linear(x, weight, None if bias is None else bias.float())
    return _linear_tiled(x, weight, bias)


def linear_quant(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for a q8_0/q4_0 ``weight [N, K]`` decoded per row tile; ``x`` f32 ``[T, K]`` -> f32 ``[T, N]``."""
    assert isinstance(weight, QuantizedTensor), type(weight)
    return _linear_tiled(x, weight, bias)


def embedding_dense(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a dense table ``[V, K]`` -> f32 ``[T, K]``."""
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return weight[ids].float()  # [T, K]


def embedding_quant(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a q8_0/q4_0 table ``[V, K]``: gather the rows' bytes, then decode -> f32 ``[T, K]``."""
    assert isinstance(weight, QuantizedTensor), type(weight)
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return _decode_rows(weight.rows(ids), 0, ids.shape[0])  # [T, K]
