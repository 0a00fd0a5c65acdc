"""Device-generic RMSNorm and the fused residual add (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``).

Dimension legend: ``T`` tokens (rows), ``K`` hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``: ``x`` f32 ``[T, K]``, ``weight [K]`` (any float dtype)
    -> f32 ``[T, K]``."""
    assert x.dim() == 2 and x.dtype == torch.float32 and tuple(weight.shape) == (x.shape[1],), (
        x.shape, x.dtype, weight.shape
    )
    return F.rms_norm(x, weight.shape, weight.float(), eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)``, both f32 ``[T, K]`` (vLLM's ``fused_add_rms_norm``)."""
    assert residual.shape == x.shape and residual.dtype == torch.float32, (x.shape, residual.shape, residual.dtype)
    h = x + residual  # [T, K]
    return rms_norm(h, weight, eps), h
