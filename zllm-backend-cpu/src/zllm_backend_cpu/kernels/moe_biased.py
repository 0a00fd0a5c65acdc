"""CPU kernels of the gpt-oss MoE ops: the top-k-then-softmax router, the clamped SwiGLU and
the biased clamped-SwiGLU expert FFN (references: :mod:`zllm.domain.moe_biased`,
:func:`zllm.domain.activation.swiglu_clamped`).

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` experts, ``k`` experts per token,
``N`` expert width, ``n_e`` rows routed to expert ``e``.

The expert FFN buckets the ``T * k`` (token, slot) pairs by expert as :mod:`.moe` does and
runs only the selected experts, each over its gathered rows, through the backend's torch
``linear`` kernel of the stack's format (a quantized stack's ``[e]`` is that expert's blocks,
decoded inside the kernel; the stack is never dequantized whole), then sums each token's
``k`` rows in ascending expert index, the reference's order.

The batch-invariant kernels (config ``runtime.batch_invariant``, :mod:`.invariant`) route in
fixed zero-padded tiles of rows, run the experts through the invariant ``linear`` kernels
and compute the clamped SwiGLU in fixed-shape padded calls (its ``sigmoid`` is
transcendental: a row's elements must not land in a SIMD vector or a scalar tail depending
on the batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm_backend_cpu.kernels import invariant
from zllm_backend_cpu.kernels.moe import (
    ROUTER_TILE,
    Linear,
    Weight,
    bucketed_experts,
    torch_linear,
    torch_linear_invariant,
)


def router_topk_softmax(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` f32 ``[T, E]``, ``k`` -> ``(topk_ids int64 [T, k], topk_weights f32 [T, k])``:
    the ``k`` largest logits (descending, ties to the lowest expert index) and their softmax."""
    assert router_logits.dim() == 2 and router_logits.dtype == torch.float32, (router_logits.shape, router_logits.dtype)
    assert 1 <= k <= router_logits.shape[1], (k, router_logits.shape)
    # torch.topk follows no rule among equal values; a stable sort of E (tens to 128) values
    # per row does, and costs little next to the experts.
    values, ids = torch.sort(router_logits, dim=-1, descending=True, stable=True)
    return ids[:, :k].contiguous(), torch.softmax(values[:, :k], dim=-1)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``:
    ``gate``, ``up`` f32 ``[T, N]`` -> a new f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32 and up.shape == gate.shape, (
        gate.shape, gate.dtype, up.shape)
    g = gate.clamp(max=limit)  # [T, N], a new tensor
    glu = torch.sigmoid(g * alpha).mul_(g)
    return up.clamp(min=-limit, max=limit).add_(1.0).mul_(glu)


def router_topk_softmax_invariant(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant :func:`router_topk_softmax`: rows in fixed zero-padded ``[RT, E]`` tiles."""
    t, e = router_logits.shape
    ids, weights = torch.empty(t, k, dtype=torch.int64), torch.empty(t, k)
    tile = torch.zeros(ROUTER_TILE, e)
    for start in range(0, t, ROUTER_TILE):
        stop = min(t, start + ROUTER_TILE)
        tile.zero_()
        tile[:stop - start] = router_logits[start:stop]
        tile_ids, tile_weights = router_topk_softmax(tile, k)
        ids[start:stop], weights[start:stop] = tile_ids[:stop - start], tile_weights[:stop - start]
    return ids, weights


def swiglu_clamped_invariant(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Batch-invariant :func:`swiglu_clamped`: the ``sigmoid`` over rows padded to a multiple of 64
    in calls of one fixed shape (as ``invariant.silu_mul_invariant``); the rest is exact-rounded
    elementwise arithmetic."""
    assert gate.dim() == 2 and gate.dtype == torch.float32 and up.shape == gate.shape, (
        gate.shape, gate.dtype, up.shape)
    t, n = gate.shape
    width = -(-n // invariant._ROW_MULTIPLE) * invariant._ROW_MULTIPLE
    rows = max(1, invariant._ROW_CALL_ELEMENTS // width)
    buf = torch.zeros(rows, width)  # [R, N']
    g = gate.clamp(max=limit)  # [T, N]
    glu = torch.empty(t, n)
    for start in range(0, t, rows):
        stop = min(t, start + rows)
        buf[:stop - start, :n] = g[start:stop] * alpha
        glu[start:stop] = torch.sigmoid(buf)[:stop - start, :n]
    return up.clamp(min=-limit, max=limit).add_(1.0).mul_(glu.mul_(g))


def moe_clamped_swiglu(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    gate_bias: torch.Tensor,
    up_bias: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The biased clamped-SwiGLU expert FFN (module doc): ``x`` f32 ``[T, K]``, ``topk_ids`` int64 /
    ``topk_weights`` f32 ``[T, k]``, ``gate_exps``/``up_exps`` ``[E, N, K]`` and ``down_exps``
    ``[E, K, N]`` dense f32/f16/bf16 or a quantized stack of any CPU format, biases ``[E, N]``,
    ``[E, N]``, ``[E, K]`` -> f32 ``[T, K]``."""
    return run_experts(x, topk_ids, topk_weights, (gate_exps, up_exps, down_exps), (gate_bias, up_bias, down_bias),
                    alpha, limit, torch_linear, swiglu_clamped)


def moe_clamped_swiglu_invariant(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    gate_bias: torch.Tensor,
    up_bias: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Batch-invariant :func:`moe_clamped_swiglu` (module doc); arguments as it."""
    return run_experts(x, topk_ids, topk_weights, (gate_exps, up_exps, down_exps), (gate_bias, up_bias, down_bias),
                    alpha, limit, torch_linear_invariant, swiglu_clamped_invariant)


def run_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             stacks: tuple[Weight, Weight, Weight], biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             alpha: float, limit: float, linear: Linear,
             swiglu: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]) -> torch.Tensor:
    """The expert FFN (module doc) with ``linear`` (a ``linear`` kernel: ``(x, weight, bias)``) for
    every projection and ``swiglu`` (a ``swiglu_clamped`` kernel) between them."""
    gate_exps, up_exps, down_exps = stacks
    gate_bias, up_bias, down_bias = biases
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    hidden = x.shape[1]
    n_experts, width, k_in = gate_exps.shape
    assert k_in == hidden and tuple(down_exps.shape) == (n_experts, hidden, width), (gate_exps.shape, down_exps.shape)

    def expert_ffn(expert: int, xs: torch.Tensor) -> torch.Tensor:
        h = swiglu(linear(xs, gate_exps[expert], gate_bias[expert].float()),
                   linear(xs, up_exps[expert], up_bias[expert].float()), alpha, limit)  # [n_e, N]
        return linear(h, down_exps[expert], down_bias[expert].float())  # [n_e, K]

    return bucketed_experts(x, topk_ids, topk_weights, n_experts, expert_ffn)
