"""f32 references of the gpt-oss Mixture-of-Experts: the top-k-then-softmax router and the
expert FFN with biases and the clamped SwiGLU.

Dimension legend: ``T`` tokens, ``K`` hidden size, ``E`` experts, ``k`` experts per token,
``N`` expert intermediate size.

Sources: OpenAI's gpt-oss model card (2025) and ``gpt_oss/torch/model.py`` ``MLPBlock``; HF
transformers 5.24 ``GptOssTopKRouter`` and ``GptOssExperts``:

- router: ``logits = x W_r^T + b_r`` (the model computes it with ``linear``), the ``k``
  largest logits, then a softmax over those ``k`` only. Mathematically this equals softmax
  over all experts, top-k, renormalised (Mixtral's rule), but the f32 roundings differ, so it
  is its own op. Ties: the lowest expert index first, the selected experts ordered by
  descending logit (a stable descending sort, as :mod:`zllm.domain.moe`).
- experts: ``down_e(swiglu_clamped(gate_e x + bg_e, up_e x + bu_e)) + bd_e`` weighted by the
  router's weight; every expert ``e`` has a bias on each projection. transformers stores
  ``gate_up_proj [E, K, 2N]`` with the gate in the even columns and ``down_proj [E, N, K]``
  (``x @ W``); the model hands this op the stacks as ``[E, N, K]`` / ``[E, K, N]`` (``x W^T``,
  the layout GGUF's ``ffn_*_exps`` and every other zllm expert stack use).
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration
from zllm.domain.activation import swiglu_clamped
from zllm.domain.linear import linear
from zllm.domain.moe import ExpertStack
from zllm.weights.formats import ALL_FORMATS


def router_topk_softmax(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row and their softmax.

    Args:
        router_logits: f32 ``[T, E]``, finite.
        k: experts per token, ``1 <= k <= E``.

    Returns:
        ``(topk_ids int64 [T, k], topk_weights f32 [T, k])``; ids by descending logit, ties
        lowest index first; each row of weights sums to 1.
    """
    assert router_logits.dim() == 2 and router_logits.dtype == torch.float32, (router_logits.shape, router_logits.dtype)
    assert 1 <= k <= router_logits.shape[1], (k, router_logits.shape)
    assert bool(torch.isfinite(router_logits).all()), "router logits are not finite"
    ids = torch.sort(router_logits, dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
    return ids, router_logits.gather(1, ids).softmax(dim=-1)  # [T, k], [T, k]


def moe_clamped_swiglu(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_exps: ExpertStack,
    up_exps: ExpertStack,
    down_exps: ExpertStack,
    gate_bias: torch.Tensor,
    up_bias: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Weighted sum of each token's selected experts, each a biased clamped-SwiGLU FFN.

    ``out[t] = sum_j w[t, j] * (down_e(swiglu_clamped(gate_e x[t] + bg_e, up_e x[t] + bu_e,
    alpha, limit)) + bd_e)`` with ``e = topk_ids[t, j]``; each expert runs once over the rows
    routed to it, experts in ascending index (transformers' ``GptOssExperts.forward``).

    Args:
        x: f32 ``[T, K]``.
        topk_ids: int64 ``[T, k]``; topk_weights: f32 ``[T, k]`` (from :func:`router_topk_softmax`).
        gate_exps, up_exps: ``[E, N, K]``; down_exps: ``[E, K, N]`` (dense, or a quantized stack
            whose ``[e]`` is one expert's weight).
        gate_bias, up_bias: ``[E, N]``; down_bias: ``[E, K]`` (any float dtype, added in f32).
        alpha, limit: the clamped SwiGLU's gain and clamp (:func:`swiglu_clamped`).

    Returns:
        f32 ``[T, K]``.
    """
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, hidden = x.shape
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == t, (
        topk_ids.shape, topk_weights.shape, x.shape)
    assert topk_ids.dtype == torch.int64 and topk_weights.dtype == torch.float32, (topk_ids.dtype, topk_weights.dtype)
    n_experts, n_inter, k_in = gate_exps.shape
    assert k_in == hidden and tuple(up_exps.shape) == (n_experts, n_inter, hidden), (gate_exps.shape, up_exps.shape)
    assert tuple(down_exps.shape) == (n_experts, hidden, n_inter), (down_exps.shape, gate_exps.shape)
    assert gate_bias.shape == up_bias.shape == (n_experts, n_inter), (gate_bias.shape, up_bias.shape)
    assert down_bias.shape == (n_experts, hidden), down_bias.shape
    assert topk_ids.numel() == 0 or (0 <= int(topk_ids.min()) and int(topk_ids.max()) < n_experts), (
        "expert id out of range", n_experts)
    out = torch.zeros_like(x)  # [T, K]
    for expert in torch.unique(topk_ids).tolist():
        rows, slots = torch.where(topk_ids == expert)  # tokens routed to this expert, and where in their top-k
        xs = x[rows]  # [n, K]
        hidden_act = swiglu_clamped(linear(xs, gate_exps[expert], gate_bias[expert].float()),
                                    linear(xs, up_exps[expert], up_bias[expert].float()), alpha, limit)  # [n, N]
        y = linear(hidden_act, down_exps[expert], down_bias[expert].float())  # [n, K]
        out.index_add_(0, rows, y * topk_weights[rows, slots, None])
    return out


OPS = (
    OpDeclaration(
        name="router_topk_softmax", variants=("f32",), args=("router_logits", "k"),
        signature="(router_logits f32 [T, E], k int) -> (topk_ids int64 [T, k], topk_weights f32 [T, k]): "
                  "the k largest logits (descending; ties: lowest expert index) and the softmax over them",
        reference="zllm.domain.moe_biased:router_topk_softmax",
        cases="zllm.conformance.cases:router_topk_softmax_cases",
    ),
    OpDeclaration(
        name="moe_clamped_swiglu", variants=ALL_FORMATS,
        args=("x", "topk_ids", "topk_weights", "gate_exps", "up_exps", "down_exps", "gate_bias", "up_bias",
              "down_bias", "alpha", "limit"),
        weight_arg="gate_exps",
        signature="(x f32 [T, K], topk_ids int64 [T, k], topk_weights f32 [T, k], gate_exps [E, N, K], "
                  "up_exps [E, N, K], down_exps [E, K, N], gate_bias [E, N], up_bias [E, N], down_bias [E, K], "
                  "alpha float, limit float) -> f32 [T, K] = sum over j of topk_weights[t, j] * "
                  "(down_e(swiglu_clamped(gate_e x[t] + bg_e, up_e x[t] + bu_e)) + bd_e), e = topk_ids[t, j]; "
                  "variant = format of the expert stacks",
        reference="zllm.domain.moe_biased:moe_clamped_swiglu",
        cases="zllm.conformance.cases:moe_clamped_swiglu_cases",
    ),
)
