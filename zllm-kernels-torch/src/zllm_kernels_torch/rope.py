"""Device-generic rotary position embeddings (Su et al. 2021, "RoFormer"; HF ``apply_rotary_pos_emb``).

Dimension legend: ``T`` tokens, ``H`` heads, ``D`` head dim, ``D2 = D // 2``.
Each pair ``(a, b)`` rotates by its angle: ``(a cos - b sin, b cos + a sin)``. The layouts
differ only in which features pair up: ``rope[neox]`` (GPT-NeoX / HF half rotation) pairs
``(i, i + D2)``, ``rope[gptj]`` (GPT-J / Meta / ggml ``NORM``) pairs ``(2i, 2i + 1)``.
"""

from __future__ import annotations

import torch


def _angles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes; ``cos``/``sin`` f32 ``[T, D2]`` broadcast over heads as ``[T, 1, D2]``."""
    assert x.dim() == 3 and x.dtype == torch.float32 and x.shape[2] % 2 == 0, (x.shape, x.dtype)
    assert tuple(cos.shape) == (x.shape[0], x.shape[2] // 2) and sin.shape == cos.shape, (x.shape, cos.shape, sin.shape)
    return cos[:, None, :], sin[:, None, :]


def _rotate(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a * c - b * s, b * c + a * s


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation layout: ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32 ``[T, D2]`` -> f32 ``[T, H, D]``."""
    c, s = _angles(x, cos, sin)
    a, b = x.chunk(2, dim=-1)  # [T, H, D2] each
    return torch.cat(_rotate(a, b, c, s), dim=-1)  # [T, H, D]


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved layout: ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32 ``[T, D2]`` -> f32 ``[T, H, D]``."""
    c, s = _angles(x, cos, sin)
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)  # [T, H, D2] each, strided
    return torch.stack(_rotate(a, b, c, s), dim=-1).flatten(-2)  # [T, H, D]
