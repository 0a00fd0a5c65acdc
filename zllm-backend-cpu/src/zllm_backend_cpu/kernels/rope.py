"""CPU kernels for rotary position embeddings: GPT-NeoX / HF half-rotation layout (``rope[neox]``)
and the interleaved GPT-J layout (``rope[gptj]``).

Dimension legend: ``T`` tokens, ``H`` heads, ``D`` head dim, ``D2 = D // 2``.
Formula (Su et al. 2021; HF ``apply_rotary_pos_emb``): pairs ``(i, i + D2)``,
``out[i] = x[i] cos - x[i+D2] sin``, ``out[i+D2] = x[i+D2] cos + x[i] sin``.
"""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` f32 ``[T, H, D]`` by ``cos``/``sin`` f32 ``[T, D2]`` -> a new f32 ``[T, H, D]``."""
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, _, d = x.shape
    half = d // 2
    assert d % 2 == 0 and tuple(cos.shape) == (t, half) and cos.shape == sin.shape, (x.shape, cos.shape, sin.shape)
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D2]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=lo)
    lo.sub_(x2 * s)
    torch.mul(x2, c, out=hi)
    hi.add_(x1 * s)
    return out


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved layout, pairs ``(2i, 2i + 1)``: ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32
    ``[T, D2]`` -> a new f32 ``[T, H, D]``."""
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, h, d = x.shape
    assert d % 2 == 0 and tuple(cos.shape) == (t, d // 2) and cos.shape == sin.shape, (x.shape, cos.shape, sin.shape)
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D2]
    pairs = x.view(t, h, d // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]  # [T, H, D2], strided
    out = torch.empty_like(x)
    o = out.view(t, h, d // 2, 2)
    torch.mul(x1, c, out=o[..., 0])
    o[..., 0].sub_(x2 * s)
    torch.mul(x2, c, out=o[..., 1])
    o[..., 1].add_(x1 * s)
    return out
