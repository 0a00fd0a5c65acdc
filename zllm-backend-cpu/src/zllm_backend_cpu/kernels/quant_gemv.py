"""``linear`` over the HF quantized kernel layouts (``fp8_e4m3``, ``int4_g``, ``int8_g``,
``mxfp4``, ``nvfp4``) through the native library (:mod:`.native`, ``csrc/quant_gemv.c``).

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``R`` rows of a
weight tile, ``G`` scale groups per row.

A weight is a :class:`~zllm.plugin_api.QuantizedTensor` of one of :data:`LAYOUTS` (parts and
kernel layouts declared in ``zllm.weights.formats``; an expert of a stack is ``weight[e]``):
``fp8_e4m3`` with any scale block ``(bn, bk)``; ``int4_g`` / ``int8_g`` with zero points and
an optional act-order ``perm`` (the kernels compute ``x[:, perm] @ W_stored^T``); ``mxfp4``;
``nvfp4``.

Decode steps (``T <= GEMV_MAX_TOKENS``) take the GEMV, which streams the quantized bytes once
and decodes them in registers; more tokens (prefill) decode :data:`~.linear.TILE_BYTES` of rows
at a time natively into one reused f32 buffer and multiply it with ``torch.mm`` (the Q8_0 path's
scheme; ``bench/quant_gemv.py`` compares the two). Activations are f32 in and out.

Numerics (``csrc/quant_gemv.c``): activations stay f32 (the reference's; the GGUF GEMV's
int16 rounding of the activations would differ numerically from dequantize-then-matmul, which
issue #14 allows only as a named variant). Each weight is decoded exactly (E4M3 through F16C,
nibbles and E2M1 through table lookups) and multiplied in f32; sums are scaled per group (or,
for 4-bit rows in 128-column chunks, per 8 columns, INT4's zero point applied as ``z`` times
the sum of ``x``). INT8 rows at the AVX-512 level (VNNI) and INT4 rows at the AVX2 level (groups of
at least 128 columns), with ``K`` and the groups multiples of 64, multiply the quants by ``x`` split
per call into four exact int8 digits (``csrc/quant_digits.c``: ``x`` held to 2^-28 of its block's
max, below f32's own rounding; a token with inf / NaN or a tiny block takes the f32 kernels alone).
Results differ from the f32 reference by rounding only (~1e-6 relative), and each output row is
computed in an order that depends only on the format, ``K``, the group size and the ISA level:
batch-invariant for any ``T`` in the GEMV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.plugin_api import QuantizedTensor
from zllm_backend_cpu.kernels.linear import _tile_rows
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function

GEMV_MAX_TOKENS = 16  # as .gemv: above it the tiled decode + torch.mm is faster
LAYOUTS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")
_INT = ("int4_g", "int8_g")

_WEIGHT_ARGS = {  # C arguments that carry the weight, before x (gemv) or N (decode)
    "fp8_e4m3": (P, P, I64, I64),  # qweight, scale, bn, bk
    "int4_g": (P, P, P, I64),  # qweight, scales, zeros, g
    "int8_g": (P, P, P, I64),
    "mxfp4": (P, P),  # qweight, scales
    "nvfp4": (P, P, F32),  # qweight, scales, global scale
}
_C_NAME = {"fp8_e4m3": "fp8", "int4_g": "int4", "int8_g": "int8", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


def _gemv_fn(fmt: str) -> Callable[..., None]:
    # (weight..., x, x row stride, bias | NULL, y, T, N, K, threads)
    return function(f"zllm_qgemv_{_C_NAME[fmt]}", *_WEIGHT_ARGS[fmt], P, I64, P, P, I64, I64, I64, INT)


def _decode_fn(fmt: str) -> Callable[..., None]:
    # (weight..., N, K, first row, end row, out, threads)
    return function(f"zllm_qdecode_{_C_NAME[fmt]}", *_WEIGHT_ARGS[fmt], I64, I64, I64, I64, P, INT)


def _weight_args(weight: QuantizedTensor) -> tuple[tuple, dict[str, torch.Tensor]]:
    """The C weight arguments, and the contiguous parts they point into (copies where a part was
    not contiguous: the caller keeps them alive until the C call returns).

    Raises:
        ValueError: a format the native kernels do not have, or a weight that is not 2-D.
    """
    if weight.fmt not in _C_NAME:
        raise ValueError(f"native quantized kernels have no format {weight.fmt!r}; expected one of "
                         f"{', '.join(LAYOUTS)}")
    if len(weight.shape) != 2:
        raise ValueError(f"native quantized kernels take a 2-D weight, got shape {list(weight.shape)}")
    parts = {name: t if t.is_contiguous() else t.contiguous() for name, t in weight.parts.items()}
    q = parts["qweight"].data_ptr()
    if weight.fmt == "fp8_e4m3":
        return (q, parts["scale"].data_ptr(), *weight.block_shape), parts
    if weight.fmt in _INT:
        return (q, parts["scales"].data_ptr(), parts["zeros"].data_ptr(), weight.block_shape[1]), parts
    if weight.fmt == "mxfp4":
        return (q, parts["scales"].data_ptr()), parts
    return (q, parts["scales"].data_ptr(), float(parts["global_scale"])), parts


def _permuted(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    perm = weight.parts.get("perm")
    return x if perm is None else x.index_select(1, perm)  # [T, K] in the weight's stored column order


def quant_gemv(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` by the native GEMV for any ``T``: ``x`` f32 ``[T, K]`` (any strides), ``weight``
    a 2-D ``[N, K]`` of :data:`LAYOUTS`, ``bias`` ``[N]`` or None -> f32 ``[T, N]``.

    Raises:
        RuntimeError: the native library is unavailable.
        ValueError: a format the native kernels do not have, or a weight that is not 2-D.
    """
    args, _parts = _weight_args(weight)  # _parts: alive until the call returns
    n, k = weight.shape
    t, xk = x.shape
    assert xk == k and x.dtype == torch.float32 and (bias is None or tuple(bias.shape) == (n,)), (
        x.shape, x.dtype, weight.shape, None if bias is None else bias.shape)
    x = _permuted(x, weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(t, n)  # [T, N]
    if t and n:
        _gemv_fn(weight.fmt)(*args, x.data_ptr(), x.stride(0), None if bias is None else bias.data_ptr(),
                             out.data_ptr(), t, n, k, torch.get_num_threads())
    return out


def decode_rows(weight: QuantizedTensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of a 2-D ``weight`` of :data:`LAYOUTS` decoded natively to f32 ``[R, K]``
    in stored column order (into ``out`` when given, a contiguous f32 ``[R, K]``), each value the
    reference's one rounding of quant times scale (nvfp4: ``e2m1 * (e4m3(scale) * global)``
    rounded twice, as the reference forms the block scale first).

    Raises as :func:`quant_gemv`.
    """
    args, _parts = _weight_args(weight)  # _parts: alive until the call returns
    n, k = weight.shape
    assert 0 <= start <= stop <= n, (start, stop, n)
    out = torch.empty(stop - start, k) if out is None else out
    assert out.shape == (stop - start, k) and out.dtype == torch.float32 and out.is_contiguous(), out.shape
    if stop > start:
        _decode_fn(weight.fmt)(*args, n, k, start, stop, out.data_ptr(), torch.get_num_threads())
    return out


def linear_quant_gemv(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b``: :func:`quant_gemv` for ``T <= GEMV_MAX_TOKENS``, else row tiles decoded by
    :func:`decode_rows` into one reused f32 buffer, each multiplied with ``torch.mm``; ``x`` f32
    ``[T, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None -> f32 ``[T, N]``."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return quant_gemv(x, weight, bias)
    n, k = weight.shape
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, weight.shape)
    x_t = _permuted(x, weight).t()  # [K, T]
    rows = min(n, _tile_rows(k))
    buf = torch.empty(rows * k)  # one reused f32 tile
    out_t = torch.empty(n, x.shape[0])  # [N, T]: a row tile of it is contiguous
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = decode_rows(weight, start, stop, buf[: (stop - start) * k].view(stop - start, k))  # [R, K]
        torch.mm(w, x_t, out=out_t[start:stop])  # [R, T]
    out = out_t.t().contiguous()  # [T, N]
    if bias is not None:
        out += bias.float()
    return out


def linear_quant_gemv_invariant(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Batch-invariant ``x @ W^T + b``: :func:`quant_gemv` for every ``T`` (each output row in a fixed
    order); shapes as :func:`quant_gemv`."""
    return quant_gemv(x, weight, bias)


__all__ = ["GEMV_MAX_TOKENS", "LAYOUTS", "decode_rows", "linear_quant_gemv",
           "linear_quant_gemv_invariant", "quant_gemv"]
