"""f32 reference of rotary position embeddings (RoPE), GPT-NeoX / HF half-rotation layout.

Dimension legend: ``T`` tokens, ``H`` heads, ``D`` head dim (even), ``D2 = D // 2``.

Formula (Su et al. 2021, "RoFormer"; HF ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``): the pairs are ``(x[i], x[i + D2])`` and rotate by angle
``pos * inv_freq[i]`` with ``inv_freq[i] = 1 / theta^(2i / D)``:

    out[i]      = x[i] * cos - x[i + D2] * sin
    out[i + D2] = x[i + D2] * cos + x[i] * sin
"""

from __future__ import annotations

import torch


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies f32 ``[D2]``: ``1 / theta^(arange(0, D, 2) / D)`` (HF ``compute_default_rope_parameters``).

    Raises:
        AssertionError: ``head_dim`` is not even and positive, or ``theta <= 0``.
    """
    assert head_dim > 0 and head_dim % 2 == 0, head_dim
    assert theta > 0, theta
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D2]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` f32 ``[T, D2]`` for int64 ``positions [T]`` and f32 ``inv_freq [D2]``."""
    assert positions.dim() == 1, positions.shape
    assert inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, (inv_freq.shape, inv_freq.dtype)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` f32 ``[T, H, D]`` by ``cos``/``sin`` f32 ``[T, D2]`` -> f32 ``[T, H, D]``."""
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, _, d = x.shape
    assert d % 2 == 0, d
    assert tuple(cos.shape) == (t, d // 2) and cos.shape == sin.shape, (cos.shape, sin.shape, x.shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]  # [T, H, D2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # [T, H, D]
