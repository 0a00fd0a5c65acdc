"""f32 reference of the gated activation used by SwiGLU MLPs.

Dimension legend: ``T`` tokens, ``N`` intermediate size.

Formula (Shazeer 2020, "GLU Variants Improve Transformer"; HF ``LlamaMLP``):
``silu(gate) * up`` with ``silu(x) = x * sigmoid(x)`` (Elfwing et al. 2017).
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` f32 ``[T, N]`` -> f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32, (gate.shape, gate.dtype)
    assert up.shape == gate.shape and up.dtype == torch.float32, (up.shape, up.dtype)
    return gate * torch.sigmoid(gate) * up  # [T, N]


OPS = (
    OpDeclaration(
        name="silu_mul", variants=("f32",), args=("gate", "up"),
        signature="(gate f32 [T, N], up f32 [T, N]) -> f32 [T, N] = silu(gate) * up",
        reference="zllm.domain.activation:silu_mul", cases="zllm.conformance.cases:silu_mul_cases",
    ),
)
