"""CPU kernel for the SwiGLU gate: ``silu(gate) * up`` (Shazeer 2020; HF ``LlamaMLP``).

Dimension legend: ``T`` tokens, ``N`` intermediate size.
"""

from __future__ import annotations

import torch


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` f32 ``[T, N]`` -> a new f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32 and up.shape == gate.shape, (
        gate.shape, gate.dtype, up.shape
    )
    return torch.nn.functional.silu(gate).mul_(up)
