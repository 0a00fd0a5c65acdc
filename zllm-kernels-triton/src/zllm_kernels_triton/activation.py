"""Gated products of SwiGLU MLPs: ``silu_mul`` and gpt-oss's ``swiglu_clamped``.

Dimension legend: ``T`` tokens, ``N`` intermediate size.

Formulas (f32): ``silu(gate) * up`` with ``silu(x) = x * sigmoid(x)`` (Shazeer 2020, "GLU
Variants Improve Transformer"; HF ``LlamaMLP``; Elfwing et al. 2017); ``(clamp(up, -limit,
limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)`` (gpt-oss; HF
``GptOssExperts._apply_gate``).

Program per (row, tile of :attr:`Tuning.silu_block_n` columns). ``gate`` and ``up`` are read
through their row strides, so the two halves of a fused gate/up projection need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.tuning import Tuning


@triton.jit
def _gated_kernel(gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_out, alpha, limit, CLAMPED: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def _gated(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, clamped: bool,
           tuning: Tuning) -> torch.Tensor:
    """Checks and launch shared by :func:`silu_mul` (``clamped`` False: ``alpha``, ``limit``
    unused) and :func:`swiglu_clamped`."""
    assert gate.dim() == 2 and gate.dtype == torch.float32, (gate.shape, gate.dtype)
    assert up.shape == gate.shape and up.dtype == torch.float32 and up.device == gate.device, (up.shape, up.dtype)
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    t, n = gate.shape
    out = torch.empty((t, n), dtype=torch.float32, device=gate.device)  # [T, N]
    if out.numel() == 0:
        return out
    block_n = min(tuning.silu_block_n, triton.next_power_of_2(n))
    _gated_kernel[(t, triton.cdiv(n, block_n))](
        gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), float(alpha), float(limit), CLAMPED=clamped,
        BLOCK_N=block_n, num_warps=tuning.silu_num_warps,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` f32 ``[T, N]`` (row-strided views allowed) -> f32 ``[T, N]``.

    Raises AssertionError on a shape, dtype or device mismatch.
    """
    return _gated(gate, up, 0.0, 0.0, False, tuning)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, *,
                   tuning: Tuning = Tuning()) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``:
    ``gate``, ``up`` f32 ``[T, N]`` (row-strided views allowed) -> f32 ``[T, N]``.

    Raises AssertionError on a shape, dtype or device mismatch.
    """
    return _gated(gate, up, alpha, limit, True, tuning)
