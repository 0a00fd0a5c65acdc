"""Rotary position embeddings (RoPE) in both pair layouts, one kernel.

Dimension legend: ``T`` tokens, ``H`` heads, ``D`` head dim (even), ``D2 = D // 2`` pairs.

Formula (Su et al. 2021, "RoFormer"; HF ``apply_rotary_pos_emb``): each pair ``(a, b)`` of a
head rotates by the angle whose ``cos``/``sin`` the caller passes per token and pair:
``a' = a * cos - b * sin``, ``b' = b * cos + a * sin``. The layout is a constexpr: ``neox``
(GPT-NeoX / HF half rotation) pairs ``(i, i + D2)``, ``gptj`` (GPT-J / Meta / ggml ``NORM``)
pairs ``(2i, 2i + 1)``. Scaled variants (linear, dynamic NTK, llama3, YaRN and its attention
factor) are already folded into ``cos``/``sin`` by the caller
(``zllm.plugin_api.rope_inv_freq`` + ``rope_cos_sin``).

Program per (token, tile of :attr:`Tuning.rope_block_h` heads), looping over the ``D2``
pairs in chunks of :attr:`Tuning.rope_block_pairs`. ``x`` is read through its strides, so
a view of a wider projection (e.g. the Q part of a fused QKV output) needs no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm_kernels_triton.tuning import Tuning


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    H, HALF,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_st, stride_ot, stride_oh,
    GPTJ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    x_base = x_ptr + t * stride_xt + heads[:, None] * stride_xh  # [BLOCK_H, 1]
    out_base = out_ptr + t * stride_ot + heads[:, None] * stride_oh  # [BLOCK_H, 1]
    for p0 in range(0, HALF, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        pair_mask = pairs < HALF
        c = tl.load(cos_ptr + t * stride_ct + pairs, mask=pair_mask, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * stride_st + pairs, mask=pair_mask, other=0.0)[None, :]
        if GPTJ:
            i1 = 2 * pairs
            i2 = i1 + 1
        else:
            i1 = pairs
            i2 = pairs + HALF
        mask = (heads[:, None] < H) & pair_mask[None, :]
        a = tl.load(x_base + i1[None, :] * stride_xd, mask=mask, other=0.0)
        b = tl.load(x_base + i2[None, :] * stride_xd, mask=mask, other=0.0)
        tl.store(out_base + i1[None, :], a * c - b * s, mask=mask)
        tl.store(out_base + i2[None, :], b * c + a * s, mask=mask)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gptj: bool, tuning: Tuning) -> torch.Tensor:
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, h, d = x.shape
    assert d % 2 == 0, d
    assert tuple(cos.shape) == (t, d // 2) and cos.shape == sin.shape, (cos.shape, sin.shape, x.shape)
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32, (cos.dtype, sin.dtype)
    assert cos.device == x.device and sin.device == x.device, (cos.device, sin.device, x.device)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty((t, h, d), dtype=torch.float32, device=x.device)  # [T, H, D]
    if out.numel() == 0:
        return out
    block_h = min(tuning.rope_block_h, triton.next_power_of_2(h))
    block_p = min(tuning.rope_block_pairs, triton.next_power_of_2(d // 2))
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, out, h, d // 2,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        GPTJ=gptj, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=tuning.rope_num_warps,
    )
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """RoPE, ``neox`` layout (pairs ``(i, i + D2)``): ``x`` f32 ``[T, H, D]`` (any strides),
    ``cos``/``sin`` f32 ``[T, D2]`` -> new f32 ``[T, H, D]``.

    Raises AssertionError on a shape, dtype or device mismatch.
    """
    return _rope(x, cos, sin, False, tuning)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, tuning: Tuning = Tuning()) -> torch.Tensor:
    """RoPE, ``gptj`` layout (interleaved pairs ``(2i, 2i + 1)``); otherwise as :func:`rope`."""
    return _rope(x, cos, sin, True, tuning)
