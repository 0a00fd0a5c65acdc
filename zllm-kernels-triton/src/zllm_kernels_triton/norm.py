"""RMSNorm and fused residual-add RMSNorm.

Dimension legend: ``T`` tokens, ``K`` hidden size.

Formula (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; HF ``LlamaRMSNorm``):
``y = x * rsqrt(mean(x^2) + eps) * weight``, all in f32 (a 16-bit weight is upcast on load).
The fused variant (vLLM ``fused_add_rms_norm``) first forms ``h = x + residual`` and returns
both ``rms_norm(h)`` and ``h`` from one pass over memory.

One program per row. A row of at most :attr:`Tuning.norm_block_k` columns stays in
registers; a longer one is read in chunks twice: sum of squares, then scale and store
(``h`` is recomputed from ``x + residual`` in the second pass rather than read back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.tuning import Tuning


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr,
    K, stride_x, stride_r, stride_out, stride_h, eps,
    HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_r
    out_row = out_ptr + row * stride_out
    h_row = h_ptr + row * stride_h
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_row + offs, mask=mask, other=0.0)
            tl.store(h_row + offs, x, mask=mask)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, x * rstd * w, mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = x + tl.load(res_row + cols, mask=mask, other=0.0)
                tl.store(h_row + cols, x, mask=mask)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = x + tl.load(res_row + cols, mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, x * rstd * w, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit column stride (rows may be strided views of a wider tensor)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    assert tuple(weight.shape) == (x.shape[1],) and weight.dtype in (torch.float32, torch.float16, torch.bfloat16), (
        weight.shape, weight.dtype, x.shape)
    assert weight.device == x.device, (weight.device, x.device)
    assert eps >= 0, eps


def _launch(x, residual, weight, out, h, eps: float, tuning: Tuning) -> None:
    t, k = x.shape
    if t == 0 or k == 0:
        return
    block_k = min(tuning.norm_block_k, triton.next_power_of_2(k))
    has_residual = residual is not None
    _rms_norm_kernel[(t,)](
        x, residual if has_residual else x, weight.contiguous(), out, h if has_residual else out,
        k, x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0), h.stride(0) if has_residual else 0,
        float(eps),
        HAS_RESIDUAL=has_residual, ONE_PASS=k <= block_k, BLOCK_K=block_k, num_warps=tuning.norm_num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """RMSNorm over the last dim: ``x`` f32 ``[T, K]``, ``weight`` f32/f16/bf16 ``[K]`` -> f32 ``[T, K]``.

    ``x`` may be a row-strided view. Raises AssertionError on a shape, dtype or device mismatch.
    """
    _check(x, weight, eps)
    x = _rows(x)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [T, K]
    _launch(x, None, weight, out, None, eps, tuning)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 tuning: Tuning = Tuning()) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = x + residual`` then RMSNorm: returns ``(rms_norm(h, weight, eps), h)``, both f32 ``[T, K]``.

    ``x``, ``residual`` f32 ``[T, K]`` (row-strided views allowed), ``weight`` f32/f16/bf16
    ``[K]``. Raises AssertionError on a shape, dtype or device mismatch.
    """
    _check(x, weight, eps)
    assert residual.shape == x.shape and residual.dtype == torch.float32 and residual.device == x.device, (
        residual.shape, residual.dtype, x.shape)
    x, residual = _rows(x), _rows(residual)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [T, K]
    h = torch.empty_like(out)  # [T, K]
    _launch(x, residual, weight, out, h, eps, tuning)
    return out, h
