"""RMSNorm, fused add + RMSNorm, RoPE (neox and gptj layouts) and SiLU-and-mul through the
native library (:mod:`.native`, ``csrc/elementwise.c``).

Dimension legend: ``T`` tokens, ``K`` hidden size, ``H`` heads, ``D`` head dim,
``D2 = D // 2``, ``N`` FFN size.

Same contracts as the torch kernels of :mod:`.norm`, :mod:`.rope` and :mod:`.activation`
(the formulas and sources are there); at decode each torch version spends ~50 us on
dispatching its 3-6 aten ops against ~1 us of arithmetic, the native call ~5 us in all.
Numerics (``csrc/elementwise.c``): f32, each row alone in a fixed order — RoPE is bit-identical
to the torch kernel, RMSNorm and SiLU differ from it by summation order / a vectorized ``exp``
(a few ulp), and every kernel is batch-invariant. Inputs may be row-strided views (q and k of
a fused QKV projection); a weight dtype or layout the native code does not take runs the torch
kernel.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import DTYPE_OF_FORMAT
from zllm_backend_cpu.kernels import activation, norm
from zllm_backend_cpu.kernels import rope as torch_rope
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function

_WEIGHT = {dtype: fmt for fmt, dtype in DTYPE_OF_FORMAT.items()}  # norm weight dtype -> entry point suffix
_RMS_NORM = {fmt: function(f"zllm_rms_norm_{fmt}", P, I64, P, P, I64, I64, F32, INT) for fmt in _WEIGHT.values()}
_ADD_RMS_NORM = {fmt: function(f"zllm_add_rms_norm_{fmt}", P, I64, P, I64, P, P, P, I64, I64, F32, INT)
                 for fmt in _WEIGHT.values()}
_ROPE_ARGS = (P, I64, I64, P, I64, P, I64, P, I64, I64, I64, INT)
_ROPE_NEOX = function("zllm_rope_neox", *_ROPE_ARGS)
_ROPE_GPTJ = function("zllm_rope_gptj", *_ROPE_ARGS)
_SILU_MUL = function("zllm_silu_mul", P, I64, P, I64, P, I64, I64, INT)


def _rows(x: torch.Tensor) -> bool:
    """``x`` is f32 ``[T, K]`` with a contiguous last dimension."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``: ``x`` f32 ``[T, K]``, ``weight [K]`` f32/f16/bf16 -> f32 ``[T, K]``."""
    t, k = x.shape
    fn = _RMS_NORM.get(_WEIGHT.get(weight.dtype, ""))
    if fn is None or not _rows(x) or weight.stride(0) != 1 or tuple(weight.shape) != (k,):
        return norm.rms_norm(x, weight, eps)
    y = torch.empty(t, k)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), t, k, eps, torch.get_num_threads())
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``, then ``(rms_norm(h), h)``: ``x``, ``residual`` f32 ``[T, K]`` -> two new f32 ``[T, K]``."""
    t, k = x.shape
    fn = _ADD_RMS_NORM.get(_WEIGHT.get(weight.dtype, ""))
    if (fn is None or not _rows(x) or not _rows(residual) or residual.shape != x.shape or weight.stride(0) != 1
            or tuple(weight.shape) != (k,)):
        return norm.add_rms_norm(x, residual, weight, eps)
    y, h = torch.empty(t, k), torch.empty(t, k)
    fn(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(), y.data_ptr(),
       h.data_ptr(), t, k, eps, torch.get_num_threads())
    return y, h


def _rope(fn, fallback, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    if (x.dtype != torch.float32 or x.stride(2) != 1 or d % 2 or not _rows(cos) or not _rows(sin)
            or tuple(cos.shape) != (t, d // 2) or sin.shape != cos.shape):
        return fallback(x, cos, sin)
    y = torch.empty(t, h, d)
    fn(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0),
       y.data_ptr(), t, h, d, torch.get_num_threads())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX layout (pairs ``(i, i + D2)``): ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32 ``[T, D2]``
    -> a new f32 ``[T, H, D]``."""
    return _rope(_ROPE_NEOX, torch_rope.rope, x, cos, sin)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J layout (pairs ``(2i, 2i + 1)``): shapes as :func:`rope`."""
    return _rope(_ROPE_GPTJ, torch_rope.rope_gptj, x, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` f32 ``[T, N]`` -> a new f32 ``[T, N]``."""
    if not _rows(gate) or not _rows(up) or up.shape != gate.shape:
        return activation.silu_mul(gate, up)
    t, n = gate.shape
    y = torch.empty(t, n)
    _SILU_MUL(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), y.data_ptr(), t, n,
              torch.get_num_threads())
    return y
