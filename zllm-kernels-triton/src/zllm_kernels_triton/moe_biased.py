"""The gpt-oss MoE ops: ``router_topk_softmax`` and ``moe_clamped_swiglu`` (references:
:mod:`zllm.domain.moe_biased`).

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` experts, ``k`` experts per token,
``N`` expert width, ``P = T * k`` (token, slot) pairs, ``BM`` pairs per block
(:attr:`Tuning.moe_block_m`).

Router: one program per token row holds the row's ``E`` logits, takes the maximum ``k``
times (each time the lowest index among equal maxima, then masks it), so the ids come out in
descending logit order with the reference's tie rule, and takes the softmax of the ``k``
values in registers.

Experts: the grouped GEMMs of :mod:`.moe` (vLLM's ``fused_moe``; pairs sorted by expert and
padded per block by :func:`~zllm_kernels_triton.moe.align_block_size`) with each expert's
bias added in the epilogue and the clamped SwiGLU in place of SiLU-and-mul: the gate/up GEMM
writes ``h[p] = swiglu_clamped(x gate_e^T + bg_e, x up_e^T + bu_e)``, the down GEMM
``w[p] * (h down_e^T + bd_e)``, then each token sums its ``k`` rows. Weights are read in
their stored format (f32, f16, bf16, Q8_0) inside the GEMMs; biases and accumulation f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton.moe import align_block_size
from zllm_kernels_triton.tuning import Tuning
from zllm_kernels_triton.weight_tile import load_weight_tile, weight_operand

Weight = torch.Tensor | QuantizedTensor


@triton.jit
def _router_kernel(logits_ptr, ids_ptr, weights_ptr, E, stride_l, stride_o, TOP_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    vals = tl.load(logits_ptr + row * stride_l + cols, mask=cols < E, other=float("-inf"))  # [BLOCK_E]
    slots = tl.arange(0, BLOCK_K)
    top_vals = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        m = tl.max(vals, axis=0)
        idx = tl.min(tl.where(vals == m, cols, BLOCK_E), axis=0)  # lowest index among equal maxima
        top_vals = tl.where(slots == j, m, top_vals)
        top_ids = tl.where(slots == j, idx.to(tl.int64), top_ids)
        vals = tl.where(cols == idx, float("-inf"), vals)
    e = tl.exp(top_vals - tl.max(top_vals, axis=0))  # masked slots: exp(-inf) = 0
    keep = slots < TOP_K
    tl.store(ids_ptr + row * stride_o + slots, top_ids, mask=keep)
    tl.store(weights_ptr + row * stride_o + slots, e / tl.sum(e, axis=0), mask=keep)


def router_topk_softmax(router_logits: torch.Tensor, k: int, *,
                        tuning: Tuning = Tuning()) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` f32 ``[T, E]`` (finite, row-strided views allowed), ``k`` -> ``(topk_ids
    int64 [T, k], topk_weights f32 [T, k])``: the ``k`` largest logits, descending, ties to the
    lowest expert index, and their softmax. Raises AssertionError on a bad shape or dtype."""
    assert router_logits.dim() == 2 and router_logits.dtype == torch.float32, (router_logits.shape,
                                                                              router_logits.dtype)
    t, e = router_logits.shape
    assert 1 <= k <= e, (k, e)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)  # [T, k]
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)  # [T, k]
    if t:
        _router_kernel[(t,)](logits, ids, weights, e, logits.stride(0), ids.stride(0), TOP_K=k,
                             BLOCK_E=max(triton.next_power_of_2(e), 2), BLOCK_K=max(triton.next_power_of_2(k), 2))
    return ids, weights


@triton.jit
def _biased_gemm_kernel(
    a_ptr, w1_ptr, w2_ptr, b1_ptr, b2_ptr, out_ptr, pairs_ptr, block_experts_ptr, weights_ptr,
    num_pairs, N, K, a_div, alpha, limit,
    stride_am, stride_w1e, stride_w1n, stride_w2e, stride_w2n, stride_b1e, stride_b2e, stride_om,
    GATED: tl.constexpr, Q8_W1: tl.constexpr, Q8_W2: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], P = padding
    pair_mask = pairs < num_pairs
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    a_rows = a_ptr + (pairs // a_div).to(tl.int64)[:, None] * stride_am  # [BM, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w1_rows = w1_ptr + expert * stride_w1e + cols.to(tl.int64)[:, None] * stride_w1n  # [BN, 1]
    w2_rows = w2_ptr + expert * stride_w2e + cols.to(tl.int64)[:, None] * stride_w2n
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc1 += tl.dot(a, tl.trans(load_weight_tile(w1_rows, ks[None, :], w_mask, Q8_W1)), input_precision=PRECISION)
        if GATED:
            acc2 += tl.dot(a, tl.trans(load_weight_tile(w2_rows, ks[None, :], w_mask, Q8_W2)),
                           input_precision=PRECISION)
    acc1 += tl.load(b1_ptr + expert * stride_b1e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        up = acc2 + tl.load(b2_ptr + expert * stride_b2e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        gate = tl.minimum(acc1, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        acc1 = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    if MUL_WEIGHT:
        acc1 = acc1 * tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :], acc1,
             mask=pair_mask[:, None] & col_mask[None, :])


def _stack(weight: Weight, what: str) -> tuple[torch.Tensor, bool]:
    data, q8 = weight_operand(weight, what)
    assert data.dim() == 3, f"{what}: an expert stack is [E, N, K], got {list(weight.shape)}"
    return data, q8


def moe_clamped_swiglu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                       up_exps: Weight, down_exps: Weight, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                       down_bias: torch.Tensor, alpha: float, limit: float, *,
                       tuning: Tuning = Tuning()) -> torch.Tensor:
    """The biased clamped-SwiGLU expert FFN (module doc).

    Args:
        x: f32 ``[T, K]``, row-strided views allowed.
        topk_ids: int64 ``[T, k]``; topk_weights: f32 ``[T, k]``.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — each f32/f16/bf16 or Q8_0.
        gate_bias, up_bias: ``[E, N]``; down_bias: ``[E, K]`` (any float dtype).
        alpha, limit: the clamped SwiGLU's gain and clamp.
        tuning: launch parameters (``moe_*``).

    Returns:
        f32 ``[T, K]``. Raises AssertionError on a shape, dtype, format or device mismatch.
    """
    t, hidden = x.shape
    n_experts, width, k_in = gate_exps.shape
    assert x.dtype == torch.float32 and k_in == hidden, (x.shape, x.dtype, gate_exps.shape)
    assert tuple(up_exps.shape) == (n_experts, width, hidden), (up_exps.shape, gate_exps.shape)
    assert tuple(down_exps.shape) == (n_experts, hidden, width), (down_exps.shape, gate_exps.shape)
    assert gate_bias.shape == up_bias.shape == (n_experts, width), (gate_bias.shape, up_bias.shape)
    assert down_bias.shape == (n_experts, hidden), down_bias.shape
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, topk_weights.shape)
    gate, gate_q8 = _stack(gate_exps, "gate_exps")
    up, up_q8 = _stack(up_exps, "up_exps")
    down, down_q8 = _stack(down_exps, "down_exps")
    assert gate.device == up.device == down.device == x.device == topk_ids.device, (gate.device, x.device)
    biases = [b if b.stride(-1) == 1 else b.contiguous() for b in (gate_bias, up_bias, down_bias)]
    x = x if x.stride(-1) == 1 else x.contiguous()
    top_k = topk_ids.shape[1]
    n_pairs = t * top_k
    if n_pairs == 0:
        return torch.zeros((t, hidden), dtype=torch.float32, device=x.device)
    block_m = tuning.moe_block_m
    pairs, block_experts = align_block_size(topk_ids, n_experts, block_m)
    weights = topk_weights.to(torch.float32).flatten().contiguous()  # [P]
    common = dict(PRECISION=tuning.dot_precision, BLOCK_M=block_m, BLOCK_N=tuning.moe_block_n,
                  BLOCK_K=tuning.moe_block_k, num_warps=tuning.moe_num_warps, num_stages=tuning.moe_num_stages)
    h = torch.empty((n_pairs, width), dtype=torch.float32, device=x.device)  # [P, N]
    _biased_gemm_kernel[(block_experts.numel(), triton.cdiv(width, tuning.moe_block_n))](
        x, gate, up, biases[0], biases[1], h, pairs, block_experts, weights,
        n_pairs, width, hidden, top_k, float(alpha), float(limit),
        x.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), biases[0].stride(0),
        biases[1].stride(0), h.stride(0),
        GATED=True, Q8_W1=gate_q8, Q8_W2=up_q8, MUL_WEIGHT=False, **common,
    )
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)  # [P, K]
    _biased_gemm_kernel[(block_experts.numel(), triton.cdiv(hidden, tuning.moe_block_n))](
        h, down, down, biases[2], biases[2], y, pairs, block_experts, weights,
        n_pairs, hidden, width, 1, float(alpha), float(limit),
        h.stride(0), down.stride(0), down.stride(1), down.stride(0), down.stride(1), biases[2].stride(0),
        biases[2].stride(0), y.stride(0),
        GATED=False, Q8_W1=down_q8, Q8_W2=down_q8, MUL_WEIGHT=True, **common,
    )
    return y.view(t, top_k, hidden).sum(dim=1)  # [T, K]
