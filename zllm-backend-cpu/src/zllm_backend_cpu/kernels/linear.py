"""CPU kernels for ``linear`` and ``embedding`` over dense (f32/f16/bf16) and quantized weights:
GGUF blocks (q8_0, q4_0, q4_1, q5_0, q5_1 here; the k-quants q2_k … q6_k in
:mod:`zllm_backend_cpu.kernels.kquants`) and the HF checkpoints' formats (fp8_e4m3, int4_g,
int8_g, mxfp4, nvfp4 in :mod:`zllm_backend_cpu.kernels.quant_hf`).

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``R`` rows of a
weight tile, ``NBK = K // 32`` blocks per row.

Low-precision and quantized weights are never expanded whole. Rows are decoded to f32 one
tile at a time into a reused f32 buffer of about :data:`TILE_BYTES` and multiplied into the
matching rows of ``out^T``. 4 MB was measured on a 2-core x86 box (4096 x 4096 q8_0, T = 1):
3x faster than expanding the 64 MB weight at once, and much more robust than 256 KB-1 MB
tiles when the cores are shared (many small parallel regions stall on a descheduled thread).
Block layouts: ggml ``ggml-common.h`` (see ``zllm.weights.formats``); the decode is the same
f32 arithmetic as the reference ``zllm.domain.quant``, so results differ from it only by
matmul summation order.

Decode steps (``T == 1``) with a bf16/f16 weight multiply in the weight's dtype instead
(activation rounded to it, f32 accumulation inside oneDNN, output rounded to it), as
llama.cpp's CPU ``vec_dot_type`` does: 2x faster than an f32 matmul and well inside the
1e-2 tolerance (relative error ~2^-9). f16 takes that path only when ``|x| < 65504``.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import QuantizedTensor
from zllm_backend_cpu.kernels.kquants import KQUANT_DECODERS
from zllm_backend_cpu.kernels.quant_hf import HF_DECODERS

TILE_BYTES = 4 << 20  # f32 working set of one decoded weight tile
QK = 32  # weights per q8_0 / q4_0 / q4_1 / q5_0 / q5_1 block
F16_MAX = 65504.0


def _tile_rows(k: int) -> int:
    """Rows per tile: an f32 ``[R, K]`` tile of about TILE_BYTES, at least 16 rows."""
    return max(16, TILE_BYTES // (4 * k))


def decode_q8_0_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode q8_0 bytes uint8 ``[R, NBK * 34]`` to f32 ``[R, K]`` (``w = d * qs``), into ``out`` if given."""
    r = data.shape[0]
    blocks = data.view(r, k // QK, 34)  # [R, NBK, 34]
    q = torch.empty(r, k // QK, QK) if out is None else out.view(r, k // QK, QK)  # [R, NBK, 32]
    q.copy_(blocks[..., 2:].view(torch.int8))
    q.mul_(blocks[..., :2].view(torch.float16))  # f16 scale [R, NBK, 1], exact in f32
    return q.view(r, k)  # [R, K]


def decode_q4_0_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode q4_0 bytes uint8 ``[R, NBK * 18]`` to f32 ``[R, K]`` (``w = d * (nibble - 8)``, low
    nibbles first), into ``out`` if given."""
    r = data.shape[0]
    blocks = data.view(r, k // QK, 18)  # [R, NBK, 18]
    qs = blocks[..., 2:]  # [R, NBK, 16]
    nibbles = torch.empty(r, k // QK, QK, dtype=torch.uint8)  # [R, NBK, 32], staged in uint8
    torch.bitwise_and(qs, 0x0F, out=nibbles[..., :16])  # weights 0..15 of each block
    torch.bitwise_right_shift(qs, 4, out=nibbles[..., 16:])  # weights 16..31
    q = torch.empty(r, k // QK, QK) if out is None else out.view(r, k // QK, QK)  # [R, NBK, 32]
    q.copy_(nibbles)
    q.sub_(8.0).mul_(blocks[..., :2].view(torch.float16))  # (n - 8) exact, then one rounding as in the reference
    return q.view(r, k)  # [R, K]


def _quants_32(blocks: torch.Tensor, qs_at: int, qh_at: int | None) -> torch.Tensor:
    """The unsigned quants of 32-weight blocks, uint8 ``[R, NBK, type_size]`` -> uint8
    ``[R, NBK, 32]``: nibbles of the 16 bytes at ``qs_at`` (low nibbles = weights 0..15, high =
    16..31), and bit 4 from the little-endian uint32 at ``qh_at`` (bit ``i`` = weight ``i``;
    q5_0/q5_1) when given."""
    r, nbk, _ = blocks.shape
    qs = blocks[..., qs_at:qs_at + 16]  # [R, NBK, 16]
    q = torch.empty(r, nbk, QK, dtype=torch.uint8)  # [R, NBK, 32]
    torch.bitwise_and(qs, 0x0F, out=q[..., :16])
    torch.bitwise_right_shift(qs, 4, out=q[..., 16:])
    if qh_at is not None:
        qh = blocks[..., qh_at:qh_at + 4]  # [R, NBK, 4]: byte j holds bit 4 of weights 8j .. 8j + 7
        high = torch.empty(r, nbk, 4, 8, dtype=torch.uint8)  # [R, NBK, j, b]: weight 8j + b
        for b in range(8):
            torch.bitwise_right_shift(qh, b, out=high[..., b]).bitwise_and_(1)
        q.bitwise_or_(high.view(r, nbk, QK).bitwise_left_shift_(4))
    return q


def _scaled(q: torch.Tensor, blocks: torch.Tensor, offset: float, with_min: bool, k: int,
            out: torch.Tensor | None) -> torch.Tensor:
    """``d * (q - offset)`` (``+ m`` when ``with_min``: f16 ``d`` at bytes 0-1, ``m`` at 2-3), in
    the reference's order: the exact shift, the product rounded to f32, then the sum."""
    r, nbk, _ = q.shape
    w = torch.empty(r, nbk, QK) if out is None else out.view(r, nbk, QK)  # [R, NBK, 32]
    w.copy_(q)
    if offset:
        w.sub_(offset)
    w.mul_(blocks[..., :2].view(torch.float16))
    if with_min:
        w.add_(blocks[..., 2:4].view(torch.float16))
    return w.view(r, k)  # [R, K]


def decode_q4_1_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode q4_1 bytes uint8 ``[R, NBK * 20]`` to f32 ``[R, K]`` (``w = d * nibble + m``), into
    ``out`` if given."""
    blocks = data.view(data.shape[0], k // QK, 20)  # [R, NBK, 20]
    return _scaled(_quants_32(blocks, 4, None), blocks, 0.0, True, k, out)


def decode_q5_0_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode q5_0 bytes uint8 ``[R, NBK * 22]`` to f32 ``[R, K]`` (``w = d * (q - 16)``), into
    ``out`` if given."""
    blocks = data.view(data.shape[0], k // QK, 22)  # [R, NBK, 22]
    return _scaled(_quants_32(blocks, 6, 2), blocks, 16.0, False, k, out)


def decode_q5_1_rows(data: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode q5_1 bytes uint8 ``[R, NBK * 24]`` to f32 ``[R, K]`` (``w = d * q + m``), into
    ``out`` if given."""
    blocks = data.view(data.shape[0], k // QK, 24)  # [R, NBK, 24]
    return _scaled(_quants_32(blocks, 8, 4), blocks, 0.0, True, k, out)


#: block layout -> ``decode(data uint8 [R, bytes per row], K, out f32 [R, K] | None) -> f32 [R, K]``.
DECODERS = {"q8_0": decode_q8_0_rows, "q4_0": decode_q4_0_rows, "q4_1": decode_q4_1_rows,
            "q5_0": decode_q5_0_rows, "q5_1": decode_q5_1_rows, **KQUANT_DECODERS}


def _decode_rows(
    weight: torch.Tensor | QuantizedTensor, start: int, stop: int, out: torch.Tensor | None = None,
    logical: bool = True,
) -> torch.Tensor:
    """Rows ``start:stop`` of ``weight`` as f32 ``[R, K]`` (written into ``out`` when given), in
    logical column order, or in stored order when not ``logical`` (an act-order ``perm`` kept:
    the caller permutes the activations)."""
    if isinstance(weight, QuantizedTensor):
        if weight.fmt in DECODERS:
            return DECODERS[weight.fmt](weight.data[start:stop], weight.shape[1], out)
        if weight.fmt not in HF_DECODERS:
            raise ValueError(f"CPU kernels have no decoder for format {weight.fmt!r}; "
                             f"expected one of {sorted({*DECODERS, *HF_DECODERS})}")
        tile = weight.rows(slice(start, stop))
        decoded = HF_DECODERS[weight.fmt](tile, torch.empty(stop - start, weight.shape[1]) if out is None else out)
        perm = weight.parts.get("perm")
        if perm is None or not logical:
            return decoded
        return decoded.index_copy_(1, perm, decoded.clone())  # stored column j is logical column perm[j]
    rows = weight[start:stop]
    return rows.float() if out is None else out.copy_(rows)


def _check(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> tuple[int, int]:
    n, k = weight.shape
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, weight.shape)
    assert bias is None or tuple(bias.shape) == (n,), (None if bias is None else bias.shape, n)
    return n, k


def _linear_tiled(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = _check(x, weight, bias)
    t = x.shape[0]
    rows = min(n, _tile_rows(k))
    buf = torch.empty(rows * k)  # one reused f32 tile
    perm = weight.parts.get("perm") if isinstance(weight, QuantizedTensor) else None
    x_t = (x if perm is None else x[:, perm]).t()  # [K, T], in the weight's stored column order
    out_t = torch.empty(n, t)  # [N, T]: a row tile of it is contiguous
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = _decode_rows(weight, start, stop, buf[: (stop - start) * k].view(stop - start, k), logical=False)
        torch.mm(w, x_t, out=out_t[start:stop])  # [R, T]
    out = out_t.t().contiguous()  # [T, N]
    if bias is not None:
        out += bias.float()
    return out


def linear_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for a dense f32/f16/bf16 ``weight [N, K]``; ``x`` f32 ``[T, K]``,
    ``bias`` ``[N]``|None -> f32 ``[T, N]``.

    f32: ``torch.nn.functional.linear``. bf16/f16: for ``T == 1`` a matmul in the weight dtype
    (see the module doc), otherwise upcast per row tile.
    """
    n, _ = _check(x, weight, bias)
    if weight.dtype == torch.float32:
        return torch.nn.functional.linear(x, weight, None if bias is None else bias.float())
    assert weight.dtype in (torch.float16, torch.bfloat16), weight.dtype
    if x.shape[0] == 1 and (weight.dtype == torch.bfloat16 or float(x.abs().max()) < F16_MAX):
        out = (x.to(weight.dtype) @ weight.t()).float()  # [1, N]
        return out if bias is None else out.add_(bias.float())
    return _linear_tiled(x, weight, bias)


def linear_quant(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for a block-quantized ``weight [N, K]`` (any of :data:`DECODERS`) decoded
    per row tile; ``x`` f32 ``[T, K]`` -> f32 ``[T, N]``."""
    assert isinstance(weight, QuantizedTensor), type(weight)
    return _linear_tiled(x, weight, bias)


def embedding_dense(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a dense f32/f16/bf16 table ``[V, K]`` -> f32 ``[T, K]``."""
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return weight[ids].float()  # [T, K]


def embedding_quant(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` int64 ``[T]`` of a block-quantized table ``[V, K]``: gather the rows' bytes,
    decode only them -> f32 ``[T, K]``."""
    assert isinstance(weight, QuantizedTensor), type(weight)
    assert ids.dim() == 1 and ids.dtype == torch.int64, (ids.shape, ids.dtype)
    return _decode_rows(weight.rows(ids), 0, ids.shape[0])  # [T, K]
