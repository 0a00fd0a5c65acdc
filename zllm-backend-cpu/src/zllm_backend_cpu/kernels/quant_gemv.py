"""``linear`` over the HF quantized kernel layouts (``fp8_e4m3``, ``int4_g``, ``int8_g``,
``mxfp4``, ``nvfp4``) through the native library (:mod:`.native`, ``csrc/quant_gemv.c``).

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``R`` rows of a
weight tile, ``G`` scale groups per row.

A weight arrives as its named parts (the kernel layouts of issue #14):

- ``fp8_e4m3``: ``qweight`` uint8 ``[N, K]`` (E4M3FN bits), ``scale`` f32
  ``[ceil(N / bn), ceil(K / bk)]`` with the block shape ``(bn, bk)`` — ``(128, 128)``
  blocks, ``(1, K)`` per channel, ``(N, K)`` per tensor;
- ``int4_g`` / ``int8_g``: ``qweight`` uint8 ``[N, K / 2]`` (low nibble = even column) or
  ``[N, K]``, ``scales`` f32 ``[N, G]``, ``zeros`` uint8 ``[N, G]`` (``g = K / G`` columns a
  group), optional ``perm`` int64 ``[K]`` (GPTQ act-order: the kernel computes
  ``x[:, perm] @ W^T``);
- ``mxfp4``: ``qweight`` uint8 ``[N, K / 2]``, ``scales`` uint8 ``[N, K / 32]`` (E8M0);
- ``nvfp4``: ``qweight`` uint8 ``[N, K / 2]``, ``scales`` uint8 ``[N, K / 16]`` (E4M3FN
  bits), ``global_scale`` f32 0-d.

Decode steps (``T <= GEMV_MAX_TOKENS``) take the GEMV, which streams the quantized bytes once
and decodes them in registers; more tokens (prefill) decode :data:`~.linear.TILE_BYTES` of rows
at a time natively into one reused f32 buffer and multiply it with ``torch.mm`` (the Q8_0 path's
scheme; ``bench/quant_gemv.py`` compares the two). Activations are f32 in and out.

Numerics (``csrc/quant_gemv.c``): ``fp8_e4m3`` multiplies exactly decoded weights (E4M3 through
F16C) with f32 activations, so it differs from the f32 reference (dequantize, then
``x @ W^T``) by rounding only (~1e-6 relative). The integer and FP4 layouts quantize ``x``
once per call to int16 per block of 32 in-features, as the GGUF GEMV does
(``s_b = max|x_b| / 32767``), and take exact integer dot products with ``q - zero`` or twice
the E2M1 value: ``|y - y_ref| <= sum_b (s_b / 2) * sum_(i in b) |w_i|`` plus f32 rounding,
about 1e-5 relative. Each output row is computed in an order that depends only on the layout
and ``K``: batch-invariant for any ``T`` in the GEMV. The GEMV needs ``K`` a multiple of 32 (and
an int group size that is a multiple of 32, or 16) except for ``fp8_e4m3``; other shapes take
the tiled path at every ``T``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from zllm_backend_cpu.kernels.linear import _tile_rows
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function

GEMV_MAX_TOKENS = 16  # as .gemv: above it the tiled decode + torch.mm is faster
LAYOUTS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")
_INT_BITS = {"int4_g": 4, "int8_g": 8}

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


def weight_shape(fmt: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """Logical ``(N, K)`` of a weight of layout ``fmt`` from its ``qweight`` part."""
    n, cols = parts["qweight"].shape
    return n, cols if fmt in ("fp8_e4m3", "int8_g") else 2 * cols


def _weight_args(fmt: str, parts: Mapping[str, torch.Tensor], block: tuple[int, int] | None, gemv: bool) -> tuple:
    """The C weight arguments of ``fmt`` (pointers into ``parts``), after checking the parts
    (and, for the GEMV, that ``K`` and the group size suit its 32-column blocks).

    Raises:
        ValueError: a layout, part, dtype or shape the native kernels do not take (naming it).
    """
    if fmt not in _C_NAME:
        raise ValueError(f"native quantized GEMV has no layout {fmt!r}; expected one of {', '.join(LAYOUTS)}")
    n, k = weight_shape(fmt, parts)

    def part(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        t = parts.get(name)
        if t is None:
            raise ValueError(f"{fmt} weight has no part {name!r}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{fmt} part {name!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
        assert t.is_contiguous(), name  # the kernel layouts are contiguous
        return t

    q = parts["qweight"]
    if q.dtype != torch.uint8 or not q.is_contiguous():
        raise ValueError(f"{fmt} part 'qweight' must be contiguous uint8, got {q.dtype}")
    if fmt == "fp8_e4m3":
        if block is None:
            raise ValueError("fp8_e4m3 needs its scale block shape (bn, bk)")
        bn, bk = block
        scale = part("scale", torch.float32, (-(-n // bn), -(-k // bk)))
        return q.data_ptr(), scale.data_ptr(), bn, bk
    if fmt in _INT_BITS:
        groups = parts["scales"].shape[-1]
        g = k // groups if groups and k % groups == 0 else 0
        if g == 0 or (gemv and (k % 32 or not (g % 32 == 0 or g == 16))):
            raise ValueError(f"{fmt}: the native GEMV needs K a multiple of 32 and a group size that is a "
                             f"multiple of 32 or 16, got K={k} in {groups} groups")
        scales = part("scales", torch.float32, (n, groups))
        zeros = part("zeros", torch.uint8, (n, groups))
        return q.data_ptr(), scales.data_ptr(), zeros.data_ptr(), g
    group = 32 if fmt == "mxfp4" else 16
    if gemv and k % 32:
        raise ValueError(f"{fmt}: the native GEMV needs K a multiple of 32, got {k}")
    scales = part("scales", torch.uint8, (n, k // group))
    if fmt == "mxfp4":
        return q.data_ptr(), scales.data_ptr()
    return q.data_ptr(), scales.data_ptr(), float(part("global_scale", torch.float32, ()))


def _permuted(x: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    perm = parts.get("perm")
    return x if perm is None else x.index_select(1, perm)  # [T, K] in the weight's column order


def quant_gemv(x: torch.Tensor, fmt: str, parts: Mapping[str, torch.Tensor], bias: torch.Tensor | None, *,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x @ W^T + b`` by the native GEMV for any ``T``: ``x`` f32 ``[T, K]`` (any strides), ``W``
    the parts of a ``fmt`` weight ``[N, K]`` (module doc; ``block`` = fp8's ``(bn, bk)``),
    ``bias`` ``[N]`` or None -> f32 ``[T, N]``.

    Raises:
        RuntimeError: the native library is unavailable.
        ValueError: see :func:`_weight_args`.
    """
    args = _weight_args(fmt, parts, block, gemv=True)
    n, k = weight_shape(fmt, parts)
    t, xk = x.shape
    assert xk == k and x.dtype == torch.float32 and (bias is None or tuple(bias.shape) == (n,)), (
        x.shape, x.dtype, (n, k), None if bias is None else bias.shape)
    x = _permuted(x, parts)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(t, n)  # [T, N]
    if t and n:
        _gemv_fn(fmt)(*args, x.data_ptr(), x.stride(0), None if bias is None else bias.data_ptr(), out.data_ptr(),
                      t, n, k, torch.get_num_threads())
    return out


def decode_rows(fmt: str, parts: Mapping[str, torch.Tensor], start: int, stop: int, out: torch.Tensor | None = None,
                *, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of a ``fmt`` weight decoded natively to f32 ``[R, K]`` (into ``out``
    when given, a contiguous f32 ``[R, K]``), each value the reference's one rounding of
    quant times scale (nvfp4: ``(e2m1 * scale) * global_scale``).

    Raises as :func:`quant_gemv`.
    """
    args = _weight_args(fmt, parts, block, gemv=False)
    n, k = weight_shape(fmt, parts)
    assert 0 <= start <= stop <= n, (start, stop, n)
    out = torch.empty(stop - start, k) if out is None else out
    assert out.shape == (stop - start, k) and out.dtype == torch.float32 and out.is_contiguous(), out.shape
    if stop > start:
        _decode_fn(fmt)(*args, n, k, start, stop, out.data_ptr(), torch.get_num_threads())
    return out


def _gemv_fits(fmt: str, parts: Mapping[str, torch.Tensor], k: int) -> bool:
    """Whether the GEMV takes this shape (module doc): its 32-column blocks and int groups."""
    if fmt == "fp8_e4m3":
        return True
    g = k // max(1, parts["scales"].shape[-1]) if fmt in _INT_BITS else 32
    return k % 32 == 0 and (g % 32 == 0 or g == 16)


def quant_linear(x: torch.Tensor, fmt: str, parts: Mapping[str, torch.Tensor], bias: torch.Tensor | None, *,
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x @ W^T + b``: :func:`quant_gemv` for ``T <= GEMV_MAX_TOKENS`` (and shapes it takes), else row tiles decoded
    by :func:`decode_rows` into one reused f32 buffer, each multiplied with ``torch.mm``;
    arguments and result as :func:`quant_gemv`."""
    n, k = weight_shape(fmt, parts)
    if x.shape[0] <= GEMV_MAX_TOKENS and _gemv_fits(fmt, parts, k):
        return quant_gemv(x, fmt, parts, bias, block=block)
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, (n, k))
    x_t = _permuted(x, parts).t()  # [K, T]
    rows = min(n, _tile_rows(k))
    buf = torch.empty(rows * k)  # one reused f32 tile
    out_t = torch.empty(n, x.shape[0])  # [N, T]: a row tile of it is contiguous
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = decode_rows(fmt, parts, start, stop, buf[: (stop - start) * k].view(stop - start, k), block=block)
        torch.mm(w, x_t, out=out_t[start:stop])  # [R, T]
    out = out_t.t().contiguous()  # [T, N]
    if bias is not None:
        out += bias.float()
    return out


__all__ = ["GEMV_MAX_TOKENS", "LAYOUTS", "decode_rows", "quant_gemv", "quant_linear", "weight_shape"]
