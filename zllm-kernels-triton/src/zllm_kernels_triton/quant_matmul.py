"""``linear[q8_0]``: f32 activations times a Q8_0 weight decoded inside the matmul.

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``QK = 32`` weights
per block, ``NBK = K / QK`` blocks per row.

Layout (ggml ``ggml/src/ggml-common.h`` ``block_q8_0``): row ``n`` of the weight is ``NBK``
blocks of 34 bytes, each a little-endian f16 scale ``d`` then 32 int8 ``qs``, and
``w[n, 32 * b + i] = d * qs[i]``. The weight stays in these bytes in memory (DESIGN
principle 7): each program loads the bytes of its ``[BLOCK_N, BLOCK_K]`` weight tile,
rebuilds ``d`` from its two bytes (bitcast to f16) and ``qs`` by an int8 bitcast, forms the
f32 tile ``d * qs`` (exact: 8 x 11 significant bits) and accumulates ``x @ w^T`` with
``tl.dot`` in f32. ``y = x W^T + b`` as ``torch.nn.functional.linear``.

Program per output tile :attr:`Tuning.linear_block_m` x :attr:`Tuning.linear_block_n`,
stepping over ``K`` by :attr:`Tuning.linear_block_k` (whole Q8_0 blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton.tuning import Tuning


@triton.jit
def _q8_0_linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    T, N, K, stride_xt, stride_wn, stride_ot,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    QB: tl.constexpr = BLOCK_K // 32  # Q8_0 blocks per K step
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < T
    col_mask = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    within = tl.arange(0, BLOCK_K) % 32  # position of each weight inside its Q8_0 block
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        q_bytes = (ks // 32) * 34 + 2 + within  # [BLOCK_K]: byte of each weight in its row
        qs = tl.load(w_rows + q_bytes[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0)
        qs = qs.to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        blocks = k0 // 32 + tl.arange(0, QB)
        block_ptr = w_rows + (blocks * 34)[None, :]  # [BLOCK_N, QB]: first byte (scale) of each block
        block_mask = col_mask[:, None] & (blocks < K // 32)[None, :]
        d_lo = tl.load(block_ptr, mask=block_mask, other=0).to(tl.uint16)
        d_hi = tl.load(block_ptr + 1, mask=block_mask, other=0).to(tl.uint16)
        d = (d_lo | (d_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BLOCK_N, QB]
        d = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK_N, QB, 32)), (BLOCK_N, BLOCK_K))
        acc += tl.dot(x, tl.trans(qs * d), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


def check_linear_args(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """``(N, K)`` of a 2-D ``weight`` after checking ``x`` f32 ``[T, K]`` and ``bias`` f32 ``[N]`` or
    None against it (the quantized ``linear`` kernels' shared checks). Raises AssertionError."""
    n, k = weight.shape
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == k, (x.shape, x.dtype, weight.shape)
    assert bias is None or (tuple(bias.shape) == (n,) and bias.dtype == torch.float32), (
        None if bias is None else (bias.shape, bias.dtype), n)
    return n, k


def linear_output(x: torch.Tensor, n: int, tuning: Tuning) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int]]:
    """``(x, out, BLOCK_M, grid)`` of a quantized ``linear`` launch: ``x`` f32 ``[T, K]`` with unit
    column stride (copied only when it lacks one), a new f32 ``out [T, N]``, rows per tile cut to
    the batch (at least :attr:`Tuning.dot_min`) and one program per output tile."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t = x.shape[0]
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)  # [T, N]
    block_m = min(tuning.linear_block_m, max(tuning.dot_min, triton.next_power_of_2(t)))
    return x, out, block_m, (triton.cdiv(t, block_m), triton.cdiv(n, tuning.linear_block_n))


def linear_q8_0(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None, *,
                tuning: Tuning = Tuning()) -> torch.Tensor:
    """``x @ W^T + b`` for a Q8_0 ``weight`` (logical ``[N, K]``, data uint8 ``[N, K / 32 * 34]``).

    ``x`` f32 ``[T, K]`` (row-strided views allowed), ``bias`` f32 ``[N]`` or None -> f32
    ``[T, N]``. Raises AssertionError on a format, shape, dtype or device mismatch.
    """
    assert isinstance(weight, QuantizedTensor) and weight.fmt == "q8_0", weight
    n, k = check_linear_args(x, weight, bias)
    data = weight.data if weight.data.stride(-1) == 1 else weight.data.contiguous()
    assert data.device == x.device and (bias is None or bias.device == x.device), (data.device, x.device)
    x, out, block_m, grid = linear_output(x, n, tuning)  # out f32 [T, N]
    if out.numel() == 0:
        return out
    t = x.shape[0]
    _q8_0_linear_kernel[grid](
        x, data, bias if bias is not None else out, out,
        t, n, k, x.stride(0), data.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION=tuning.dot_precision,
        BLOCK_M=block_m, BLOCK_N=tuning.linear_block_n, BLOCK_K=tuning.linear_block_k,
        num_warps=tuning.linear_num_warps, num_stages=tuning.linear_num_stages,
    )
    return out
