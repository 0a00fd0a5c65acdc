"""``linear`` for decode steps through the native GEMV kernels (:mod:`.native`, ``csrc/gemv.c``).

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features.

A decode step multiplies one token (or a few: one per running sequence) by every weight, so
it is bound by memory bandwidth: the native kernels stream each weight once in its stored
format (f32, f16, bf16, GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks, and the k-quants
Q2_K/Q3_K/Q4_K/Q5_K/Q6_K in ``csrc/kquant_gemv.c``) — no decoded copy of a tile is written and
read back, and bf16 is not multiplied on oneDNN's compute-bound bf16 path; for f32 it streams
faster than ``torch.nn.functional.linear`` at one token. Dense weights are converted to f32 in
registers and accumulated in f32. For the block formats, ``x`` is quantized once per call to
int16 per block of 32 in-features (``s_b = max|x_b| / 32767``, ``q = round(x / s_b)``; a block
of zeros gets ``s_b = 0``) and each weight block of 32 takes an exact integer dot product
(int8 / 2- to 6-bit weights times int16 activations), scaled by ``d_w * s_b`` in f32; Q4_1 and
Q5_1 add ``m_w * s_b`` times the block's integer sum of ``q``. The k-quants take the same
products with their sub-block scales (``d * sc`` in f32 per block of 32 for Q4_K/Q5_K, per
16-weight half block for Q6_K/Q3_K/Q2_K) and their mins (Q4_K/Q5_K/Q2_K: ``dmin * m`` times
``s_b`` times the integer sum of ``q`` over the sub-block, computed once per call). Half the
instructions of converting every weight to f32, which made these formats instruction-bound.
Up to :data:`GEMV_MAX_TOKENS` tokens share one read of the weight from memory; more tokens
(prefill) take the torch kernels of :mod:`.linear`.

Numerics: dense formats: f32 products of the exactly converted weights, summed in f32 — only
the summation order differs from the f32 reference, so results agree with it to ~1e-6
relative. Block formats: against the exact product with the dequantized weights ``w``::

    |y - y_ref| <= sum over blocks b of (s_b / 2) * sum_(i in b) |w_i|   (plus f32 rounding)

(``|x_i - s_b q_i| <= s_b / 2``; the f32 rounding is that of ``x / s_b``, of ``d_w * s_b`` and
of the sum over the ``K / 32`` blocks; for Q4_1/Q5_1/Q4_K/Q5_K/Q2_K, whose scale and min parts
are rounded apart, relative to ``sum (|d_w q| + |m_w|) |x|``), about 1e-5 relative for
activations of similar magnitudes within a block. A NaN or infinite activation makes every
quantized output of its token NaN. Each output element is reduced in one fixed order that
depends only on the format and ``K``, and ``x``'s quantization only on its own row
(``csrc/gemv.c``), so an output row is bit-identical whatever else is in the call and
whatever the thread count:
:func:`linear_gemv_invariant` is batch-invariant for any ``T``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.plugin_api import DTYPE_OF_FORMAT, QuantizedTensor
from zllm_backend_cpu.kernels import GEMV_FORMATS
from zllm_backend_cpu.kernels import linear as torch_linear
from zllm_backend_cpu.kernels.native import I64, INT, P, function

# T above this takes the torch kernels: on a 2-core AVX2 machine (every linear of a 110M Llama,
# 2 threads) the native kernels were 1.4-2x faster than torch at T = 16, about even at 24 and
# slower at 32 (f32, bf16)
GEMV_MAX_TOKENS = 16

FORMATS = GEMV_FORMATS  # one entry point zllm_gemv_<format> each
_DENSE_FORMATS = {dtype: name for name, dtype in DTYPE_OF_FORMAT.items()}
# zllm_gemv_<format>(w, w_row_stride, x, x_row_stride, bias | NULL, y, T, N, K, threads)
_ARGTYPES = (P, I64, P, I64, P, P, I64, I64, I64, INT)
_BOUND: dict[str, Callable] = {}  # format -> bound entry point


def gemv(x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` by the native kernels for any ``T``: ``x`` f32 ``[T, K]`` (any strides),
    ``weight [N, K]`` dense f32/f16/bf16 or a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K
    :class:`QuantizedTensor`, ``bias`` ``[N]`` or None -> f32 ``[T, N]``.

    Raises:
        RuntimeError: the native library is unavailable (see :mod:`.native`).
        ValueError: a weight format the native kernels do not have.
    """
    fmt = weight.fmt if isinstance(weight, QuantizedTensor) else _DENSE_FORMATS.get(weight.dtype)
    fn = _BOUND.get(fmt or "") or _bind(fmt, weight)
    # uint8 [N, K / block size * block bytes] for the block formats
    w = weight.data if isinstance(weight, QuantizedTensor) else weight
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
        raise ValueError(
            f"native GEMV kernels have no format {fmt or weight.dtype!r}; expected one of {', '.join(FORMATS)}"
        )
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


def linear_gemv_invariant(
    x: torch.Tensor, weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Batch-invariant ``x @ W^T + b``: native GEMV for every ``T`` (module doc); shapes as :func:`gemv`."""
    return gemv(x, weight, bias)
