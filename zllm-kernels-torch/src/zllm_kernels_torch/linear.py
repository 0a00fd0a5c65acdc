"""Device-generic kernels for ``embedding`` and ``linear``: dense f32/f16/bf16 weights and GGUF Q8_0.

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``V`` vocabulary
rows, ``R`` rows of a weight tile, ``NBK = K // 32`` Q8_0 blocks per row.

Dense f16/bf16 weights run the GEMM in the weight's dtype,
``F.linear(x.to(w.dtype), w).float()``: cuBLAS, rocBLAS and MPS accumulate it in f32, so
the only extra error is rounding the activation and the output to the weight dtype
(relative 2^-11 for f16, 2^-8 for bf16 per element) — well inside the 1e-2 kernel
tolerance, and how HF transformers and vLLM run 16-bit checkpoints. An f16 activation
beyond +-65504 becomes inf, as in any f16 model run; no check is made for it because the
check would be a host sync on every call.

Q8_0 (ggml ``block_q8_0``: f16 scale ``d`` + 32 int8 ``qs``, ``w = d * qs``; see
``zllm.weights.formats``) is never expanded whole: ``linear`` decodes one tile of about
:data:`TILE_BYTES` of f32 rows at a time, ``embedding`` gathers the rows' bytes and decodes
only those. The decode is the reference's f32 arithmetic (``zllm.domain.quant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import QuantizedTensor

QK = 32  # weights per Q8_0 block
Q8_0_BLOCK_BYTES = 34  # f16 scale + 32 int8
TILE_BYTES = 16 << 20  # f32 working set of one decoded weight tile


def decode_q8_0(data: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 bytes uint8 ``[R, NBK * 34]`` -> f32 ``[R, K]`` on ``data``'s device."""
    blocks = data.view(data.shape[0], k // QK, Q8_0_BLOCK_BYTES)  # [R, NBK, 34]
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, NBK, 1]
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()  # [R, NBK, 32]
    return (qs * scale).flatten(1)  # [R, K]


def _check_linear(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> None:
    n, k = weight.shape
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, weight.shape)
    assert bias is None or tuple(bias.shape) == (n,), (None if bias is None else bias.shape, n)


def linear_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b``: ``x`` f32 ``[T, K]``, dense ``weight [N, K]`` (f32/f16/bf16), ``bias`` ``[N]``
    or None -> f32 ``[T, N]``.

    f16/bf16 weights multiply in their own dtype with f32 accumulation (module doc).
    """
    _check_linear(x, weight, bias)
    if weight.dtype == torch.float32:
        return F.linear(x, weight, None if bias is None else bias.float())
    assert weight.dtype in (torch.float16, torch.bfloat16), weight.dtype
    out = F.linear(x.to(weight.dtype), weight).float()  # [T, N]
    return out if bias is None else out.add_(bias.float())


def linear_q8_0(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for a Q8_0 ``weight [N, K]`` decoded one row tile at a time; ``x`` f32
    ``[T, K]`` -> f32 ``[T, N]``."""
    assert isinstance(weight, QuantizedTensor) and weight.fmt == "q8_0", weight
    _check_linear(x, weight, bias)
    n, k = weight.shape
    rows = max(1, TILE_BYTES // (4 * k))
    out = torch.cat([x @ decode_q8_0(weight.data[i : i + rows], k).t() for i in range(0, n, rows)], dim=1)  # [T, N]
    return out if bias is None else out.add_(bias.float())


def embedding_dense(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a dense ``weight [V, K]`` (f32/f16/bf16) -> f32 ``[T, K]``."""
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return F.embedding(ids, weight).float()  # [T, K]


def embedding_q8_0(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a Q8_0 table ``[V, K]``: gathers those rows' bytes and decodes
    only them -> f32 ``[T, K]``."""
    assert isinstance(weight, QuantizedTensor) and weight.fmt == "q8_0", weight
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return decode_q8_0(weight.data[ids], weight.shape[1])  # [T, K]
