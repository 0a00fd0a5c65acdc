"""``linear`` for decode steps through the native GEMV kernels (:mod:`.native`, ``csrc/gemv.c``).

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features.

A decode step multiplies one token (or a few: one per running sequence) by every weight, so
it is bound by memory bandwidth: the native kernels stream each weight once in its stored
format (f32, f16, bf16, GGUF Q8_0/Q4_0 blocks), convert it to f32 in registers and
accumulate in f32 — no decoded copy of a tile is written and read back, and bf16 is not
multiplied on oneDNN's compute-bound bf16 path; for f32 it streams faster than
``torch.nn.functional.linear`` at one token. Up to :data:`GEMV_MAX_TOKENS` tokens share one
read of the weight from memory; more tokens (prefill) take the torch kernels of
:mod:`.linear`.

Numerics: f32 products of the exactly converted weights, summed in f32 — only the summation
order differs from the f32 reference (and for Q8_0/Q4_0 the block scale ``d`` multiplies the
block's sum instead of each weight), so results agree with it to ~1e-6 relative. Each output
element is reduced in one fixed order that depends only on the format and ``K``
(``csrc/gemv.c``), so an output row is bit-identical whatever else is in the call:
:func:`linear_gemv_invariant` is batch-invariant for any ``T``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.plugin_api import QuantizedTensor
from zllm_backend_cpu.kernels import linear as torch_linear
from zllm_backend_cpu.kernels.native import I64, INT, P, function

# T above this takes the torch kernels: on a 2-core AVX2 machine (every linear of a 110M Llama,
# 2 threads) the native kernels were 1.4-2x faster than torch at T = 16, about even at 24 and
# slower at 32 (f32, bf16)
GEMV_MAX_TOKENS = 16

FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0")  # one entry point zllm_gemv_<format> each
_DENSE_FORMATS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# zllm_gemv_<format>(w, w_row_stride, x, x_row_stride, bias | NULL, y, T, N, K, threads)
_ARGTYPES = (P, I64, P, I64, P, P, I64, I64, I64, INT)
_BOUND: dict[str, Callable] = {}  # format -> bound entry point


def gemv(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` by the native kernels for any ``T``: ``x`` f32 ``[T, K]`` (any strides),
    ``weight [N, K]`` dense f32/f16/bf16 or a Q8_0/Q4_0 :class:`QuantizedTensor`, ``bias``
    ``[N]`` or None -> f32 ``[T, N]``.

    Raises:
        RuntimeError: the native library is unavailable (see :mod:`.native`).
        ValueError: a weight format the native kernels do not have.
    """
    if isinstance(weight, QuantizedTensor):
        fmt, w = weight.fmt, weight.data  # uint8 [N, K / 32 * block bytes]
    else:
        fmt, w = _DENSE_FORMATS.get(weight.dtype), weight
    fn = _BOUND.get(fmt) or _bind(fmt, weight)
    n, k = weight.shape
    t, xk = x.shape
    assert xk == k and x.dtype == torch.float32 and (bias is None or tuple(bias.shape) == (n,)), (
        x.shape, x.dtype, weight.shape, None if bias is None else bias.shape)
    if w.stride(1) != 1:
        w = w.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(t, n)  # [T, N]
    if t and n:
        fn(w.data_ptr(), w.stride(0), x.data_ptr(), x.stride(0), None if bias is None else bias.data_ptr(),
           out.data_ptr(), t, n, k, torch.get_num_threads())
    return out


def _bind(fmt: str | None, weight) -> Callable:
    """Bind ``zllm_gemv_<fmt>`` on first use (the library loads then, so importing this module
    needs no library)."""
    if fmt not in FORMATS:
        raise ValueError(f"native GEMV kernels have no format {fmt or weight.dtype!r}; expected one of {', '.join(FORMATS)}")
    _BOUND[fmt] = function(f"zllm_gemv_{fmt}", *_ARGTYPES)
    return _BOUND[fmt]


def linear_gemv(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b``: native GEMV for ``T <= GEMV_MAX_TOKENS``, else the torch kernel of
    :mod:`.linear`; ``x`` f32 ``[T, K]``, ``weight [N, K]`` (as :func:`gemv`) -> f32 ``[T, N]``."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return gemv(x, weight, bias)
    if isinstance(weight, QuantizedTensor):
        return torch_linear.linear_quant(x, weight, bias)
    return torch_linear.linear_dense(x, weight, bias)


def linear_gemv_invariant(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Batch-invariant ``x @ W^T + b``: native GEMV for every ``T`` (module doc); shapes as :func:`gemv`."""
    return gemv(x, weight, bias)
