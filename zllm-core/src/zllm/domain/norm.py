"""f32 reference of RMSNorm.

Dimension legend: ``T`` tokens, ``K`` hidden size.

Formula (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; HF
``transformers.models.llama.modeling_llama.LlamaRMSNorm``):
``y = x / sqrt(mean(x^2) + eps) * weight``, computed in f32.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x`` f32 ``[T, K]``, ``weight`` ``[K]`` (any float dtype) -> f32 ``[T, K]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    assert tuple(weight.shape) == (x.shape[1],), (weight.shape, x.shape)
    assert eps >= 0, eps
    variance = x.pow(2).mean(dim=-1, keepdim=True)  # [T, 1]
    return x * torch.rsqrt(variance + eps) * weight.float()  # [T, K]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm (the pre-norm block boundary of Llama-style models).

    ``h = x + residual``; returns ``(rms_norm(h, weight, eps), h)``: both f32 ``[T, K]``;
    ``x``, ``residual`` f32 ``[T, K]``, ``weight`` ``[K]``. Same f32 operations as
    :func:`rms_norm` after the add, so the fused kernels of a backend (vLLM's
    ``fused_add_rms_norm``) are checked against exactly the unfused math.
    """
    assert x.shape == residual.shape and residual.dtype == torch.float32, (x.shape, residual.shape, residual.dtype)
    h = x + residual  # [T, K]
    return rms_norm(h, weight, eps), h


OPS = (
    OpDeclaration(
        name="rms_norm", variants=("f32",), args=("x", "weight", "eps"),
        signature="(x f32 [T, K], weight [K], eps float) -> f32 [T, K]",
        reference="zllm.domain.norm:rms_norm", cases="zllm.conformance.cases:rms_norm_cases",
    ),
    OpDeclaration(
        name="add_rms_norm", variants=("f32",), args=("x", "residual", "weight", "eps"),
        signature="(x f32 [T, K], residual f32 [T, K], weight [K], eps float) -> "
                  "(rms_norm(x + residual) f32 [T, K], x + residual f32 [T, K])",
        reference="zllm.domain.norm:add_rms_norm", cases="zllm.conformance.cases:add_rms_norm_cases",
    ),
)
