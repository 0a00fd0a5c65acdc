"""CPU kernels for the ``moe`` op: the Mixture-of-Experts FFN as llama.cpp's ``mul_mat_id``
computes it (``ggml-cpu.c``, ``ggml_compute_forward_mul_mat_id``).

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` routed experts, ``k`` experts per
token, ``N`` expert width, ``n_e`` rows routed to expert ``e``, ``RT`` rows of a router tile.

1. Route: the core's f32 router (:func:`zllm.plugin_api.select_experts`: softmax/sigmoid,
   groups, correction bias, renormalisation; ties to the lowest expert index), so every
   backend's choice of experts agrees with the reference bit for bit.
2. Bucket: the ``T * k`` (token, slot) pairs are sorted by expert (stable), so each expert's
   rows are one contiguous run of the order.
3. Only the experts some token selected run, each over its gathered rows ``x[rows] [n_e, K]``,
   through the backend's own ``linear`` and ``silu_mul`` kernels in the weights' stored
   format: ``gate_exps[e]`` of a quantized stack is that expert's blocks, decoded inside the
   ``linear`` kernel a row tile at a time; a stack is never dequantized whole.
4. Weighted sum: each pair's ``w * y`` is written in bucket order, then each token sums its
   ``k`` rows in ascending expert index, the order of the reference (one gather and ``k`` adds
   over ``[T, K]``, not a scatter per expert), then the shared experts are added
   (``sigmoid(x gate^T) *`` the shared FFN for Qwen2-MoE).

:func:`moe` and :func:`moe_invariant` differ only in the ``linear`` / ``silu_mul`` kernels
they run (registered in :mod:`zllm_backend_cpu.kernels`); ``moe_gemv`` of :mod:`.moe_gemv` runs
this algorithm in one native call per layer (``csrc/moe.c``) and uses :func:`moe_kernel`'s loop
only for weights the native GEMV does not have (the HF checkpoints' formats of :mod:`.quant_gemv`).

The batch-invariant kernels make every output row bit-identical whatever else is in the batch: the router
and the shared-expert gate run over fixed ``[RT, E]`` / ``[RT, 1]`` tiles (an elementwise
``softmax``/``sigmoid`` over a tensor whose size changes with ``T`` puts a row's elements in
SIMD lanes or a scalar tail depending on ``T``), the experts through the invariant ``linear``
and ``silu_mul`` kernels, and a row's sum runs over its experts in ascending index whatever
the batch holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.plugin_api import (
    QuantizedTensor,
    RouterConfig,
    RouterOutput,
    SharedExperts,
    select_experts,
)
from zllm_backend_cpu.kernels import activation, invariant
from zllm_backend_cpu.kernels import linear as linear_kernels

Weight = torch.Tensor | QuantizedTensor
Linear = Callable[[torch.Tensor, Weight, torch.Tensor | None], torch.Tensor]
SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ROUTER_TILE = invariant.ROW_TILE  # rows per router call in the batch-invariant kernels


def torch_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch ``linear`` kernel of ``weight``'s format (:mod:`.linear`)."""
    if isinstance(weight, QuantizedTensor):
        return linear_kernels.linear_quant(x, weight, bias)
    return linear_kernels.linear_dense(x, weight, bias)


def torch_linear_invariant(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The batch-invariant torch ``linear`` kernel of ``weight``'s format (:mod:`.invariant`)."""
    if isinstance(weight, QuantizedTensor):
        return invariant.linear_quant_invariant(x, weight, bias)
    return invariant.linear_dense_invariant(x, weight, bias)


def in_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over fixed ``[RT, C]`` zero-padded tiles of ``x [T, C]``, rows kept in order (a
    batch-invariant elementwise ``fn``)."""
    t, c = x.shape
    tile = torch.zeros(ROUTER_TILE, c)
    parts = []
    for start in range(0, t, ROUTER_TILE):
        stop = min(t, start + ROUTER_TILE)
        tile.zero_()
        tile[: stop - start] = x[start:stop]
        parts.append(fn(tile)[: stop - start])
    return torch.cat(parts) if parts else fn(x)


def route_in_tiles(
    router_logits: torch.Tensor, router: RouterConfig, correction_bias: torch.Tensor | None
) -> RouterOutput:
    """:func:`select_experts` over fixed ``[RT, E]`` zero-padded tiles of ``router_logits``
    ``[T, E]``: a token's experts and weights whatever else is in the batch."""
    ids, weights = [], []
    for start in range(0, router_logits.shape[0], ROUTER_TILE):
        rows = router_logits[start : start + ROUTER_TILE]
        tile = torch.zeros(ROUTER_TILE, router.num_experts)
        tile[: rows.shape[0]] = rows
        routed = select_experts(tile, router, correction_bias)
        ids.append(routed.topk_ids[: rows.shape[0]])
        weights.append(routed.topk_weights[: rows.shape[0]])
    if not ids:
        return select_experts(router_logits, router, correction_bias)
    return RouterOutput(torch.cat(ids), torch.cat(weights))


def bucketed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_experts: int,
                     expert_ffn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_ffn(topk_ids[t, j], x[t])`` per token, summed in ascending
    expert index: the ``T * k`` (token, slot) pairs bucketed by expert, ``expert_ffn(e, xs)``
    (``xs`` f32 ``[n_e, K]``, the bucket's rows gathered contiguous, ascending token) -> f32
    ``[n_e, K]`` run once per selected expert. ``x`` f32 ``[T, K]``, ``topk_ids`` int64 /
    ``topk_weights`` f32 ``[T, k]`` -> a new f32 ``[T, K]``."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    order = torch.argsort(topk_ids.flatten(), stable=True)  # (token, slot) pairs bucketed by expert
    counts = torch.bincount(topk_ids.flatten(), minlength=n_experts).tolist()  # [E]
    flat_weights = topk_weights.flatten()
    weighted = torch.empty(t * top_k, hidden)  # [T * k, K]: w * y of every pair, in bucket order
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]  # [n_e], ascending token within the bucket
        y = expert_ffn(expert, x[pairs // top_k])  # [n_e, K]
        torch.mul(y, flat_weights[pairs, None], out=weighted[start : start + count])
        start += count
    # Each token's rows of `weighted`, in ascending expert index (the buckets' order; a token
    # selects an expert at most once), then summed slot by slot: the reference's order, with
    # k adds over [T, K] instead of one scatter per expert (a decode step's scatters cost more
    # than its sums).
    position = torch.empty_like(order)
    position[order] = torch.arange(t * top_k)
    mine = weighted[position.view(t, top_k).sort(dim=1).values]  # [T, k, K]
    out = mine[:, 0].clone()  # [T, K]
    for slot in range(1, top_k):
        out += mine[:, slot]
    return out


def _moe(
    x: torch.Tensor,
    routing: RouterOutput,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    shared: SharedExperts | None,
    linear: Linear,
    silu_mul: SiluMul,
    gate_sigmoid: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    hidden = x.shape[1]
    n_experts, width, k_in = gate_exps.shape
    assert k_in == hidden and tuple(up_exps.shape) == (n_experts, width, hidden), (
        gate_exps.shape,
        up_exps.shape,
    )
    assert tuple(down_exps.shape) == (n_experts, hidden, width), (down_exps.shape, gate_exps.shape)

    def expert_ffn(expert: int, xs: torch.Tensor) -> torch.Tensor:
        h = silu_mul(
            linear(xs, gate_exps[expert], None), linear(xs, up_exps[expert], None)
        )  # [n_e, N]
        return linear(h, down_exps[expert], None)  # [n_e, K]

    out = bucketed_experts(x, routing.topk_ids, routing.topk_weights, n_experts, expert_ffn)  # [T, K]
    if shared is not None:
        y = linear(
            silu_mul(linear(x, shared.gate_proj, None), linear(x, shared.up_proj, None)),
            shared.down_proj,
            None,
        )  # [T, K]
        if shared.shared_expert_gate is not None:
            y = y.mul_(
                gate_sigmoid(linear(x, shared.shared_expert_gate.float(), None))
            )  # [T, K] * [T, 1]
        out += y
    return out


def check_args(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig) -> None:
    """Internal invariants of the ``moe`` op's inputs: f32 ``x [T, K]``, f32 logits ``[T, E]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    assert tuple(router_logits.shape) == (x.shape[0], router.num_experts), (
        router_logits.shape,
        x.shape,
    )
    assert router_logits.dtype == torch.float32, router_logits.dtype


def run_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    router: RouterConfig,
    gate_exps: Weight,
    up_exps: Weight,
    down_exps: Weight,
    correction_bias: torch.Tensor | None,
    shared: SharedExperts | None,
    *,
    linear: Linear,
    silu_mul: SiluMul,
    batch_invariant: bool,
) -> torch.Tensor:
    """Route, bucket, run the selected experts through ``linear`` / ``silu_mul``, weighted sum
    (module doc); ``batch_invariant`` tiles the router and the shared-expert gate."""
    check_args(x, router_logits, router)
    if batch_invariant:
        routing = route_in_tiles(router_logits, router, correction_bias)
        return _moe(
            x,
            routing,
            gate_exps,
            up_exps,
            down_exps,
            shared,
            linear,
            silu_mul,
            lambda z: in_tiles(torch.sigmoid, z),
        )
    routing = select_experts(router_logits, router, correction_bias)
    return _moe(x, routing, gate_exps, up_exps, down_exps, shared, linear, silu_mul, torch.sigmoid)


def moe_kernel(name: str, linear: Linear, silu_mul: SiluMul, *, batch_invariant: bool,
               doc: str) -> Callable[..., torch.Tensor]:
    """A kernel of the ``moe`` op's signature, ``(x, router_logits, router, gate_exps, up_exps,
    down_exps, correction_bias=None, shared=None) -> f32 [T, K]``, running :func:`run_moe`
    with ``linear``, ``silu_mul`` and ``batch_invariant``; ``name`` and ``doc`` label it."""

    def kernel(x: torch.Tensor, router_logits: torch.Tensor, router: RouterConfig, gate_exps: Weight,
               up_exps: Weight, down_exps: Weight, correction_bias: torch.Tensor | None = None,
               shared: SharedExperts | None = None) -> torch.Tensor:
        return run_moe(x, router_logits, router, gate_exps, up_exps, down_exps, correction_bias, shared,
                       linear=linear, silu_mul=silu_mul, batch_invariant=batch_invariant)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc
    return kernel


moe = moe_kernel(
    "moe", torch_linear, activation.silu_mul, batch_invariant=False,
    doc="""The MoE FFN (module doc) through the torch ``linear`` kernels of the weights' format.

    ``x`` f32 ``[T, K]``; ``router_logits`` f32 ``[T, E]``; ``router`` the layer's routing
    settings; ``gate_exps``, ``up_exps`` ``[E, N, K]`` and ``down_exps`` ``[E, K, N]``, dense
    f32/f16/bf16 or a quantized stack of any CPU format; ``correction_bias`` f32 ``[E]``
    (``noaux_tc`` routers) or None; ``shared`` experts (any CPU format) or None -> f32 ``[T, K]``.""",
)

moe_invariant = moe_kernel(
    "moe_invariant", torch_linear_invariant, invariant.silu_mul_invariant, batch_invariant=True,
    doc="""Batch-invariant :func:`moe`: tiled router and gate, invariant torch ``linear`` and
    ``silu_mul`` (module doc); arguments as :func:`moe`.""",
)
