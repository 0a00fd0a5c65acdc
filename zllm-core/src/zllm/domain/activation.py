"""f32 references of the gated activations used by SwiGLU MLPs.

Dimension legend: ``T`` tokens, ``N`` intermediate size.

Formulas:

- ``silu_mul`` (Shazeer 2020, "GLU Variants Improve Transformer"; HF ``LlamaMLP``):
  ``silu(gate) * up`` with ``silu(x) = x * sigmoid(x)`` (Elfwing et al. 2017).
- ``swiglu_clamped`` (gpt-oss; HF transformers 5.24 ``GptOssExperts._apply_gate``, OpenAI's
  ``gpt_oss/torch/model.py`` ``swiglu``): ``g = min(gate, limit)``, ``u = clamp(up, -limit,
  limit)``, ``(u + 1) * g * sigmoid(alpha * g)``; gpt-oss uses ``alpha = 1.702`` and
  ``limit = 7.0`` (``swiglu_alpha``, ``swiglu_limit``).
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` f32 ``[T, N]`` -> f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32, (gate.shape, gate.dtype)
    assert up.shape == gate.shape and up.dtype == torch.float32, (up.shape, up.dtype)
    return gate * torch.sigmoid(gate) * up  # [T, N]


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``:
    ``gate``, ``up`` f32 ``[T, N]``, ``alpha`` the sigmoid's gain, ``limit`` > 0 -> f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32, (gate.shape, gate.dtype)
    assert up.shape == gate.shape and up.dtype == torch.float32, (up.shape, up.dtype)
    assert limit > 0, limit
    g = gate.clamp(max=limit)  # [T, N]; only from above: a very negative gate already gives ~0
    u = up.clamp(min=-limit, max=limit)  # [T, N]
    return (u + 1) * (g * torch.sigmoid(g * alpha))  # [T, N], in transformers' order of operations


OPS = (
    OpDeclaration(
        name="silu_mul", variants=("f32",), args=("gate", "up"),
        signature="(gate f32 [T, N], up f32 [T, N]) -> f32 [T, N] = silu(gate) * up",
        reference="zllm.domain.activation:silu_mul", cases="zllm.conformance.cases:silu_mul_cases",
    ),
    OpDeclaration(
        name="swiglu_clamped", variants=("f32",), args=("gate", "up", "alpha", "limit"),
        signature="(gate f32 [T, N], up f32 [T, N], alpha float, limit float) -> f32 [T, N] = "
                  "(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)",
        reference="zllm.domain.activation:swiglu_clamped", cases="zllm.conformance.cases:swiglu_clamped_cases",
    ),
)
