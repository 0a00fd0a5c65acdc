"""``moe`` (and gpt-oss's ``moe_clamped_swiglu``) with the experts' rows through the native GEMV
kernels (:mod:`.gemv`) and the native ``silu_mul`` (:mod:`.elementwise`); the algorithms are
:mod:`.moe`'s and :mod:`.moe_biased`'s.

Dimension legend as in :mod:`.moe`.

A decode step routes each token to ``k`` experts, so each selected expert multiplies a bucket
of a few rows: the native GEMV streams that expert's blocks once in their stored format, the
bandwidth-bound case it is written for (only the selected experts' bytes are read). Buckets
of more than 16 rows (prefill) and k-quant weights, which the native GEMV does not have, take
the torch kernels. Registered only when the native library loads.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import format_of
from zllm_backend_cpu.kernels import elementwise, gemv, moe_biased
from zllm_backend_cpu.kernels.moe import Linear, Weight, moe_kernel, torch_linear, torch_linear_invariant


def _gemv_or(native: Linear, fallback: Linear) -> Linear:
    """``native`` for the formats the native GEMV has, ``fallback`` for the others (k-quants)."""

    def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return (native if format_of(weight) in gemv.FORMATS else fallback)(x, weight, bias)

    return linear


_LINEAR = _gemv_or(gemv.linear_gemv, torch_linear)
_LINEAR_INVARIANT = _gemv_or(gemv.linear_gemv_invariant, torch_linear_invariant)


moe_gemv = moe_kernel(
    "moe_gemv", _LINEAR, elementwise.silu_mul, batch_invariant=False,
    doc=""":func:`~zllm_backend_cpu.kernels.moe.moe` with each bucket of up to 16 rows through the
    native GEMV (one read of the expert's blocks), larger ones and k-quant weights through the
    torch kernels; arguments as :func:`~zllm_backend_cpu.kernels.moe.moe`. Raises RuntimeError
    when the native library is unavailable (the plugin registers this kernel only when it loads).""",
)

moe_gemv_invariant = moe_kernel(
    "moe_gemv_invariant", _LINEAR_INVARIANT, elementwise.silu_mul, batch_invariant=True,
    doc="""Batch-invariant :func:`moe_gemv`: native GEMV for every bucket (batch-invariant for any
    row count), the invariant torch ``linear`` for k-quants, the native ``silu_mul`` (each row
    alone), tiled router and gate; arguments as :func:`~zllm_backend_cpu.kernels.moe.moe`.""",
)


def moe_clamped_swiglu_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_exps: Weight,
                            up_exps: Weight, down_exps: Weight, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                            down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """:func:`~zllm_backend_cpu.kernels.moe_biased.moe_clamped_swiglu` with each bucket of up to 16
    rows through the native GEMV (one read of the expert's weights), larger ones and the formats
    the GEMV does not have through the torch kernels; arguments as it."""
    return moe_biased.run_experts(x, topk_ids, topk_weights, (gate_exps, up_exps, down_exps),
                                  (gate_bias, up_bias, down_bias), alpha, limit, _LINEAR, moe_biased.swiglu_clamped)
