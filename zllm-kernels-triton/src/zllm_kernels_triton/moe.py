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
bf16 stacks ``[E, N, K]``; Q8_0 stacks whose uint8 ``[E, N, K / 32 * 34]`` blocks are decoded
per tile (:func:`~zllm_kernels_triton.weight_tile.load_weight_tile`); or stacks in one of the
HF checkpoints' formats (``fp8_e4m3``, ``int4_g``, ``int8_g``, ``mxfp4``, ``nvfp4``: every
part with the expert first, ``zllm.weights.formats``), each tile decoded by the ``linear``
kernel's own :func:`~zllm_kernels_triton.quant_hf.quant_weight_tile` at the block's expert
(NVFP4: that expert's ``global_scale``). An act-order ``perm`` ``[E, K]`` is applied to the
activations as in ``linear``: the block's rows are read at ``x[p // k, perm[e]]``, and with the
gate and up stacks each through its own permutation. Activations and accumulation are f32;
``tl.dot`` uses :attr:`Tuning.dot_precision`. Each of the three stacks (and each
shared-expert weight) may be in its own format; another block format (Q4_K ...) is rejected
with an AssertionError naming the weight and its format.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from zllm.plugin_api import DTYPE_OF_FORMAT, QuantizedTensor, RouterConfig, SharedExperts, select_experts
from zllm_kernels_triton.quant_hf import FORMAT_CODES, quant_operand, quant_weight_tile
from zllm_kernels_triton.tuning import Tuning
from zllm_kernels_triton.weight_tile import load_weight_tile, weight_operand

Weight = torch.Tensor | QuantizedTensor


#: ``FMT`` of :func:`_expert_tile` for the formats outside :data:`~.quant_hf.FORMAT_CODES` (0-4).
_DENSE: tl.constexpr = tl.constexpr(-2)
_Q8_0: tl.constexpr = tl.constexpr(-1)


@triton.jit
def _expert_tile(w_ptr, s_ptr, z_ptr, gs_ptr, expert, rows, ks, mask, stride_we, stride_wn, stride_se, stride_sn,
                 BN, G, FMT: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """f32 tile ``w[expert, rows, ks]`` of an expert stack (:func:`_operand_args`): ``rows`` int64
    ``[BLOCK_N, 1]``, ``ks`` ``[BLOCK_K]``, ``mask`` ``[BLOCK_N, BLOCK_K]``; masked elements are 0."""
    if FMT == _DENSE:
        w = load_weight_tile(w_ptr + expert * stride_we + rows * stride_wn, ks[None, :], mask, False)
    elif FMT == _Q8_0:
        w = load_weight_tile(w_ptr + expert * stride_we + rows * stride_wn, ks[None, :], mask, True)
    else:
        global_scale = 1.0
        if FMT == 4:  # nvfp4: one global scale per expert
            global_scale = tl.load(gs_ptr + expert)
        w = quant_weight_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se,
                              global_scale, rows, ks, mask, stride_wn, stride_sn, BN, G, FMT, FP8_NATIVE)
    return w


@triton.jit
def _activation_tile(a_rows, perm_ptr, expert, ks, mask, K, PERM: tl.constexpr):
    """f32 ``a[rows, ks]`` (``a_rows`` ``[BLOCK_M, 1]`` row pointers), or with act-order ``PERM``
    the columns ``perm[expert, ks]``: ``x @ W^T = x[:, perm] @ W_stored^T``."""
    cols = ks
    if PERM:
        cols = tl.load(perm_ptr + expert * K + ks, mask=ks < K, other=0)
    return tl.load(a_rows + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, out_ptr, pairs_ptr, block_experts_ptr, weights_ptr, b1_ptr, b2_ptr,
    w1_ptr, w1_s_ptr, w1_z_ptr, w1_perm_ptr, w1_gs_ptr, w2_ptr, w2_s_ptr, w2_z_ptr, w2_perm_ptr, w2_gs_ptr,
    num_pairs, N, K, a_div, alpha, limit, stride_am, stride_om, stride_b1e, stride_b2e,
    stride_w1e, stride_w1n, stride_w1se, stride_w1sn, w1_bn, w1_g,
    stride_w2e, stride_w2n, stride_w2se, stride_w2sn, w2_bn, w2_g,
    W1_FMT: tl.constexpr, W1_PERM: tl.constexpr, W2_FMT: tl.constexpr, W2_PERM: tl.constexpr,
    FP8_NATIVE: tl.constexpr, GATED: tl.constexpr, BIASED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], P = padding
    pair_mask = pairs < num_pairs
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    a_rows = a_ptr + (pairs // a_div).to(tl.int64)[:, None] * stride_am  # [BM, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows = cols.to(tl.int64)[:, None]  # [BN, 1]: weight rows of this output tile
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a_mask = pair_mask[:, None] & k_mask[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        a = _activation_tile(a_rows, w1_perm_ptr, expert, ks, a_mask, K, W1_PERM)  # [BM, BK]
        w1 = _expert_tile(w1_ptr, w1_s_ptr, w1_z_ptr, w1_gs_ptr, expert, rows, ks, w_mask, stride_w1e, stride_w1n,
                          stride_w1se, stride_w1sn, w1_bn, w1_g, W1_FMT, FP8_NATIVE)  # [BN, BK]
        acc1 += tl.dot(a, tl.trans(w1), input_precision=PRECISION)
        if GATED:
            if W2_PERM:  # act-order: each weight reads x through its own permutation
                a = _activation_tile(a_rows, w2_perm_ptr, expert, ks, a_mask, K, True)
            elif W1_PERM:
                a = _activation_tile(a_rows, w2_perm_ptr, expert, ks, a_mask, K, False)
            w2 = _expert_tile(w2_ptr, w2_s_ptr, w2_z_ptr, w2_gs_ptr, expert, rows, ks, w_mask, stride_w2e,
                              stride_w2n, stride_w2se, stride_w2sn, w2_bn, w2_g, W2_FMT, FP8_NATIVE)
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


#: Formats of the expert stacks the kernels read: dense, Q8_0 (:mod:`.weight_tile`) and the HF
#: checkpoints' formats (:mod:`.quant_hf`).
EXPERT_FORMATS = (*DTYPE_OF_FORMAT, "q8_0", *FORMAT_CODES)
_DENSE_FORMAT = {dtype: fmt for fmt, dtype in DTYPE_OF_FORMAT.items()}


def _operand_args(weight: Weight, what: str, name: str) -> dict[str, Any]:
    """The ``{name}_*`` arguments of :func:`_grouped_gemm_kernel` for an expert stack ``[E, N, K]``
    (``name``: ``w1`` or ``w2``). Parts are contiguous in their last dim (copied only if they
    were not); the pointers a format has no part for point at its data and are never read.

    Raises AssertionError naming ``what`` for a format outside :data:`EXPERT_FORMATS` or a
    stack that is not 3-D.
    """
    fmt = weight.fmt if isinstance(weight, QuantizedTensor) else _DENSE_FORMAT.get(weight.dtype, str(weight.dtype))
    assert fmt in EXPERT_FORMATS, f"{what}: format {fmt!r} (the fused MoE reads {', '.join(EXPERT_FORMATS)})"
    assert len(weight.shape) == 3, f"{what}: an expert stack is [E, N, K], got {list(weight.shape)}"
    if isinstance(weight, QuantizedTensor) and fmt in FORMAT_CODES:
        w = quant_operand(weight)
        q, scales, code, (bn, g) = w.qweight, w.scales, w.code, w.block
        zeros, perm, global_scale = w.zeros, w.perm, w.global_scale
    else:
        q, q8 = weight_operand(weight, what)  # dense [E, N, K] or Q8_0 bytes [E, N, K / 32 * 34]
        scales, code, (bn, g) = q, _Q8_0.value if q8 else _DENSE.value, (1, 1)
        zeros, perm, global_scale = q, None, None
    return {
        f"{name}_ptr": q, f"{name}_s_ptr": scales, f"{name}_z_ptr": zeros,
        f"{name}_perm_ptr": q if perm is None else perm, f"{name}_gs_ptr": q if global_scale is None else global_scale,
        f"stride_{name}e": q.stride(0), f"stride_{name}n": q.stride(1),
        f"stride_{name}se": scales.stride(0), f"stride_{name}sn": scales.stride(1), f"{name}_bn": bn, f"{name}_g": g,
        f"{name.upper()}_FMT": code, f"{name.upper()}_PERM": perm is not None,
    }


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                  up_exps: Weight, down_exps: Weight, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])`` with ``e = topk_ids[t, j]``.

    Args:
        x: f32 ``[T, K]``, row-strided views allowed.
        topk_ids: int64 ``[T, k]``; topk_weights: f32 ``[T, k]``.
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — each in one of
            :data:`EXPERT_FORMATS`, independently (GGUF files may store them in different types).
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
    gate = _operand_args(gate_exps, "gate_exps", "w1")
    up = _operand_args(up_exps, "up_exps", "w2")
    # the down GEMM is not gated and never reads w2: the same stack fills its arguments
    down = {**_operand_args(down_exps, "down_exps", "w1"), **_operand_args(down_exps, "down_exps", "w2")}
    assert gate["w1_ptr"].device == up["w2_ptr"].device == down["w1_ptr"].device == x.device == topk_ids.device, (
        gate["w1_ptr"].device, x.device)
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
    common = dict(pairs_ptr=pairs, block_experts_ptr=block_experts, weights_ptr=weights, num_pairs=n_pairs,
                  alpha=float(alpha), limit=float(limit), FP8_NATIVE=tuning.fp8_convert == "e4m3fn",
                  BIASED=biases is not None, PRECISION=tuning.dot_precision, BLOCK_M=block_m,
                  BLOCK_N=tuning.moe_block_n, BLOCK_K=tuning.moe_block_k, num_warps=tuning.moe_num_warps,
                  num_stages=tuning.moe_num_stages)
    h = torch.empty((n_pairs, width), dtype=torch.float32, device=x.device)  # [P, N]
    _grouped_gemm_kernel[(block_experts.numel(), triton.cdiv(width, tuning.moe_block_n))](
        a_ptr=x, out_ptr=h, b1_ptr=b_gate, b2_ptr=b_up, N=width, K=hidden, a_div=top_k, stride_am=x.stride(0),
        stride_om=h.stride(0), stride_b1e=b_gate.stride(0), stride_b2e=b_up.stride(0), **gate, **up,
        GATED=True, MUL_WEIGHT=False, **common,
    )
    y = torch.empty((n_pairs, hidden), dtype=torch.float32, device=x.device)  # [P, K]
    _grouped_gemm_kernel[(block_experts.numel(), triton.cdiv(hidden, tuning.moe_block_n))](
        a_ptr=h, out_ptr=y, b1_ptr=b_down, b2_ptr=b_down, N=hidden, K=width, a_div=1, stride_am=h.stride(0),
        stride_om=y.stride(0), stride_b1e=b_down.stride(0), stride_b2e=b_down.stride(0), **down,
        GATED=False, MUL_WEIGHT=True, **common,
    )
    return y.view(t, top_k, hidden).sum(dim=1)  # [T, K]


def _one_expert(weight: Weight) -> Weight:
    """``weight [N, K]`` as a stack of one expert ``[1, N, K]`` (a view)."""
    if isinstance(weight, QuantizedTensor):
        return QuantizedTensor({name: t.unsqueeze(0) for name, t in weight.parts.items()}, weight.fmt,
                               (1, *weight.shape), block=weight.block)
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
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` — each in one of
            :data:`EXPERT_FORMATS`.
        correction_bias: f32 ``[E]`` (``noaux_tc`` routers) or None.
        shared: shared experts (weights in :data:`EXPERT_FORMATS`) or None.
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
