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
their stored format inside the GEMMs (f32, f16, bf16, Q8_0 and the HF checkpoints' formats,
:data:`~zllm_kernels_triton.moe.EXPERT_FORMATS`: gpt-oss's MXFP4 experts stay MXFP4); biases
and accumulation f32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton.moe import grouped_experts
from zllm_kernels_triton.tuning import Tuning

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


def moe_clamped_swiglu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                       up_exps: Weight, down_exps: Weight, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                       down_bias: torch.Tensor, alpha: float, limit: float, *,
                       tuning: Tuning = Tuning()) -> torch.Tensor:
    """The biased clamped-SwiGLU expert FFN (module doc).

    Args:
        x: f32 ``[T, K]``, row-strided views allowed.
        topk_ids: int64 ``[T, k]``; topk_weights: f32 ``[T, k]``.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — each in one of
            :data:`~zllm_kernels_triton.moe.EXPERT_FORMATS`.
        gate_bias, up_bias: ``[E, N]``; down_bias: ``[E, K]`` (any float dtype).
        alpha, limit: the clamped SwiGLU's gain and clamp.
        tuning: launch parameters (``moe_*``).

    Returns:
        f32 ``[T, K]``. Raises AssertionError on a shape, dtype, format or device mismatch.
    """
    n_experts, width, hidden = gate_exps.shape
    assert gate_bias.shape == up_bias.shape == (n_experts, width), (gate_bias.shape, up_bias.shape)
    assert down_bias.shape == (n_experts, hidden), down_bias.shape
    return grouped_experts(x, topk_ids, topk_weights, gate_exps, up_exps, down_exps, (gate_bias, up_bias, down_bias),
                           alpha, limit, tuning=tuning)
