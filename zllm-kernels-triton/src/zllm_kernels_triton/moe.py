"""The ``moe`` op: fused Mixture-of-Experts FFN over (token, expert) pairs sorted by expert.

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` routed experts, ``k`` experts per
token, ``N`` expert width, ``P = T * k`` (token, slot) pairs, ``BM`` pairs per block
(:attr:`Tuning.moe_block_m`), ``P'`` pairs after padding each expert to a multiple of ``BM``.

Source: vLLM's ``fused_moe`` (``vllm/model_executor/layers/fused_moe/fused_moe.py``:
``moe_align_block_size`` then ``fused_moe_kernel``, a grouped GEMM whose every row block
belongs to one expert), the way llama.cpp's ``mul_mat_id`` buckets rows per expert.

1. Route: the core's f32 router (:func:`zllm.plugin_api.select_experts`), so the experts
   chosen agree with the reference exactly (ties to the lowest expert index).
2. Align (:func:`align_block_size`): the ``P`` pairs, pair ``p = t * k + j`` for slot ``j`` of
   token ``t``, sorted by expert (stable), each expert's run padded with the sentinel ``P``
   to a multiple of ``BM``; one expert id per ``BM`` block. Experts no token chose get no
   block, so their weights are never read.
3. Gate/up GEMM with SiLU-and-mul: program per (block, ``N`` tile) reads its expert's
   ``gate_exps[e]`` and ``up_exps[e]`` tiles once for the block's rows ``x[p // k]`` and
   writes ``h[p] = silu(x gate^T) * (x up^T)`` (f32 ``[P, N]``).
4. Down GEMM: the same kernel over ``h`` with ``down_exps[e]``, each row scaled by its
   combine weight ``topk_weights[p]`` in the epilogue (f32 ``[P, K]``).
5. Sum over each token's ``k`` slots (``[T, k, K] -> [T, K]``, no atomics, so the result
   does not depend on scheduling), plus the shared experts, which run through the same two
   GEMMs as one expert every token selects, with combine weight 1 (DeepSeek) or Qwen2-MoE's
   ``sigmoid(x shared_expert_gate^T)``.

Weights are read in their stored format inside the GEMMs (DESIGN principle 7): f32, f16 or
bf16 stacks ``[E, N, K]``, or Q8_0 stacks whose uint8 ``[E, N, K / 32 * 34]`` blocks are
decoded per tile (:func:`~zllm_kernels_triton.weight_tile.load_weight_tile`). Activations and
accumulation are f32; ``tl.dot`` uses :attr:`Tuning.dot_precision`. Each of the three stacks
(and each shared-expert weight) may be in its own format; another block format (Q4_K ...) is
rejected with an AssertionError naming the weight and its format.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor, RouterConfig, SharedExperts, select_experts
from zllm_kernels_triton.tuning import Tuning
from zllm_kernels_triton.weight_tile import load_weight_tile, weight_operand

Weight = torch.Tensor | QuantizedTensor


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w1_ptr, w2_ptr, b1_ptr, b2_ptr, out_ptr, pairs_ptr, block_experts_ptr, weights_ptr,
    num_pairs, N, K, a_div, alpha, limit,
    stride_am, stride_w1e, stride_w1n, stride_w2e, stride_w2n, stride_b1e, stride_b2e, stride_om,
    GATED: tl.constexpr, BIASED: tl.constexpr, Q8_W1: tl.constexpr, Q8_W2: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        w1 = load_weight_tile(w1_rows, ks[None, :], w_mask, Q8_W1)  # [BN, BK]
        acc1 += tl.dot(a, tl.trans(w1), input_precision=PRECISION)
        if GATED:
            w2 = load_weight_tile(w2_rows, ks[None, :], w_mask, Q8_W2)
            acc2 += tl.dot(a, tl.trans(w2), input_precision=PRECISION)
    if BIASED:  # gpt-oss: per-expert biases and the clamped SwiGLU (zllm_kernels_triton.moe_biased)
        acc1 += tl.load(b1_ptr + expert * stride_b1e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up = acc2 + tl.load(b2_ptr + expert * stride_b2e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            gate = tl.minimum(acc1, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            acc1 = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    elif GATED:
        acc1 = acc1 * tl.sigmoid(acc1) * acc2  # silu(gate) * up
    if MUL_WEIGHT:
        acc1 = acc1 * tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :], acc1,
             mask=pair_mask[:, None] & col_mask[None, :])


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert and padded per ``block_m`` block (vLLM ``moe_align_block_size``).

    Args:
        topk_ids: int64 ``[T, k]``, each in ``[0, E)``.
        num_experts: ``E``.
        block_m: pairs per block ``BM``.

    Returns:
        ``(pairs, block_experts)``: int32 ``[P']`` pair indices ``t * k + j``, each expert's
        in ascending order and padded with ``P``; int32 ``[P' / BM]`` the expert of each block.
    """
    flat = topk_ids.flatten()  # [P]
    n_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # [P]: pairs bucketed by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_start = torch.cumsum(padded, 0) - padded  # [E]: first padded slot of each expert
    run_start = torch.cumsum(counts, 0) - counts  # [E]: first sorted pair of each expert
    sorted_experts = flat[order]  # [P]
    rank = torch.arange(n_pairs, device=flat.device) - run_start[sorted_experts]  # place in its run
    total = int(padded.sum())
    pairs = torch.full((total,), n_pairs, dtype=torch.int32, device=flat.device)  # [P']
    pairs[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=flat.device), padded // block_m,
        output_size=total // block_m)  # [P' / BM]
    return pairs, block_experts


def _expert_stack(weight: Weight, what: str) -> tuple[torch.Tensor, bool]:
    data, q8 = weight_operand(weight, what)
    assert data.dim() == 3, f"{what}: an expert stack is [E, N, K], got {list(weight.shape)}"
    return data, q8


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                  up_exps: Weight, down_exps: Weight, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])`` with ``e = topk_ids[t, j]``.

    Args:
        x: f32 ``[T, K]``, row-strided views allowed.
        topk_ids: int64 ``[T, k]``; topk_weights: f32 ``[T, k]``.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — each f32/f16/bf16 or
            Q8_0, independently (GGUF files may store them in different types).
        tuning: launch parameters (``moe_*``).

    Returns:
        f32 ``[T, K]``. Raises AssertionError on a shape, dtype, format or device mismatch.
    """
    return grouped_experts(x, topk_ids, topk_weights, gate_exps, up_exps, down_exps, tuning=tuning)


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                    up_exps: Weight, down_exps: Weight, biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                    | None = None, alpha: float = 0.0, limit: float = 0.0, *, tuning: Tuning = Tuning()
                    ) -> torch.Tensor:
    """The two grouped GEMMs and the weighted sum (module doc) behind :func:`fused_experts` and
    :func:`zllm_kernels_triton.moe_biased.moe_clamped_swiglu`.

    Args as :func:`fused_experts`, plus ``biases``: None for SiLU-and-mul without biases, or
    ``(gate_bias [E, N], up_bias [E, N], down_bias [E, K])`` (any float dtype) for gpt-oss's
    biased clamped SwiGLU with gain ``alpha`` and clamp ``limit``.

    Returns:
        f32 ``[T, K]``. Raises AssertionError on a shape, dtype, format or device mismatch.
    """
    t, hidden = x.shape
    n_experts, width, k_in = gate_exps.shape
    assert x.dtype == torch.float32 and k_in == hidden, (x.shape, x.dtype, gate_exps.shape)
    assert tuple(up_exps.shape) == (n_experts, width, hidden), (up_exps.shape, gate_exps.shape)
    assert tuple(down_exps.shape) == (n_experts, hidden, width), (down_exps.shape, gate_exps.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, topk_weights.shape)
    gate, gate_q8 = _expert_stack(gate_exps, "gate_exps")
    up, up_q8 = _expert_stack(up_exps, "up_exps")
    down, down_q8 = _expert_stack(down_exps, "down_exps")
    assert gate.device == up.device == down.device == x.device == topk_ids.device, (gate.device, x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    top_k = topk_ids.shape[1]
    n_pairs = t * top_k
    if n_pairs == 0:
        return torch.zeros((t, hidden), dtype=torch.float32, device=x.device)
    # Without biases the kernel never reads the bias pointers; x stands in for them.
    b_gate, b_up, b_down = (x, x, x) if biases is None else (
        b if b.stride(-1) == 1 else b.contiguous() for b in biases)
    block_m = tuning.moe_block_m
    pairs, block_experts = align_block_size(topk_ids, n_experts, block_m)
    weights = topk_weights.to(torch.float32).flatten().contiguous()  # [P]
    common = dict(BIASED=biases is not None, PRECISION=tuning.dot_precision, BLOCK_M=block_m,
                  BLOCK_N=tuning.moe_block_n, BLOCK_K=tuning.moe_block_k, num_warps=tuning.moe_num_warps,
                  num_stages=tuning.moe_num_stages)
    h = torch.empty((n_pairs, width), dtype=torch.float32, device=x.device)  # [P, N]
    _grouped_gemm_kernel[(block_experts.numel(), triton.cdiv(width, tuning.moe_block_n))](
        x, gate, up, b_gate, b_up, h, pairs, block_experts, weights,
        n_pairs, width, hidden, top_k, float(alpha), float(limit),
        x.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), b_gate.stride(0), b_up.stride(0),
        h.stride(0),
        GATED=True, Q8_W1=gate_q8, Q8_W2=up_q8, MUL_WEIGHT=False, **common,
    )
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)  # [P, K]
    _grouped_gemm_kernel[(block_experts.numel(), triton.cdiv(hidden, tuning.moe_block_n))](
        h, down, down, b_down, b_down, y, pairs, block_experts, weights,
        n_pairs, hidden, width, 1, float(alpha), float(limit),
        h.stride(0), down.stride(0), down.stride(1), down.stride(0), down.stride(1), b_down.stride(0),
        b_down.stride(0), y.stride(0),
        GATED=False, Q8_W1=down_q8, Q8_W2=down_q8, MUL_WEIGHT=True, **common,
    )
    return y.view(t, top_k, hidden).sum(dim=1)  # [T, K]


def _one_expert(weight: Weight) -> Weight:
    """``weight [N, K]`` as a stack of one expert ``[1, N, K]`` (a view)."""
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor(weight.data.unsqueeze(0), weight.fmt, (1, *weight.shape))
    return weight.unsqueeze(0)


def shared_experts(x: torch.Tensor, shared: SharedExperts, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """The shared experts' f32 ``[T, K]`` for ``x`` f32 ``[T, K]``: the fused GEMMs over one
    expert every token selects, weighted 1 or by Qwen2-MoE's ``sigmoid(x gate^T)``."""
    t = x.shape[0]
    ids = torch.zeros((t, 1), dtype=torch.int64, device=x.device)  # [T, 1]
    if shared.shared_expert_gate is None:
        weights = torch.ones((t, 1), dtype=torch.float32, device=x.device)
    else:
        assert tuple(shared.shared_expert_gate.shape) == (1, x.shape[1]), shared.shared_expert_gate.shape
        weights = torch.sigmoid(x @ shared.shared_expert_gate.float().T)  # [T, 1]
    return fused_experts(x, ids, weights, _one_expert(shared.gate_proj), _one_expert(shared.up_proj),
                         _one_expert(shared.down_proj), tuning=tuning)


def moe(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig, gate_exps: Weight, up_exps: Weight,
        down_exps: Weight, correction_bias: torch.Tensor | None = None, shared: SharedExperts | None = None, *,
        tuning: Tuning = Tuning()) -> torch.Tensor:
    """The ``moe`` op (module doc): route in f32, fused expert GEMMs, weighted sum, shared experts.

    Args:
        x: f32 ``[T, K]``.
        router_logits: f32 ``[T, E]``.
        router: the layer's routing settings.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — f32/f16/bf16 or Q8_0.
        correction_bias: f32 ``[E]`` (``noaux_tc`` routers) or None.
        shared: shared experts (f32/f16/bf16 or Q8_0 weights) or None.
        tuning: launch parameters.

    Returns:
        f32 ``[T, K]``. Raises AssertionError on a shape, dtype, format or device mismatch.
    """
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    assert tuple(router_logits.shape) == (x.shape[0], router.num_experts), (router_logits.shape, x.shape)
    routing = select_experts(router_logits, router, correction_bias)
    out = fused_experts(x, routing.topk_ids, routing.topk_weights, gate_exps, up_exps, down_exps, tuning=tuning)
    if shared is not None:
        out += shared_experts(x, shared, tuning=tuning)
    return out
