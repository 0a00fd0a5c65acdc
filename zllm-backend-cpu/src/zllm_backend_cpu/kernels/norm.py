"""CPU kernel for RMSNorm (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``), via ``torch.nn.functional.rms_norm``.

Dimension legend: ``T`` tokens, ``K`` hidden size.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``: ``x`` f32 ``[T, K]``, ``weight`` ``[K]`` (any float
    dtype) -> f32 ``[T, K]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    assert tuple(weight.shape) == (x.shape[1],), (weight.shape, x.shape)
    return torch.nn.functional.rms_norm(x, (x.shape[1],), weight.float(), eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (into a new tensor), then ``(rms_norm(h), h)``; all f32 ``[T, K]``."""
    assert x.shape == residual.shape and residual.dtype == torch.float32, (x.shape, residual.shape)
    h = torch.add(x, residual)  # [T, K]
    return rms_norm(h, weight, eps), h
