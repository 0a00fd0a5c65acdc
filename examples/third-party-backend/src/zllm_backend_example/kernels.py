"""Plain torch f32 kernels with the signatures in ``zllm.capabilities.ops``.

Dimension legend: ``T`` tokens, ``S`` sequences, ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim, ``K`` in-features, ``N`` out-features, ``V`` vocabulary, ``NB`` cache
blocks, ``BS`` block size, ``MB`` max blocks per sequence.

Each kernel is checked against zllm's f32 reference of the same op
(``tests/plugins/test_third_party.py``). Only f32 weights are declared, so the weight ops
may assume a dense f32 tensor; the asserts say so instead of silently upcasting.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import AttentionMetadata


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight`` f32 ``[V, K]``, ``ids`` int64 ``[T]`` -> f32 ``[T, K]``."""
    assert weight.dtype == torch.float32 and ids.dtype == torch.int64, (weight.dtype, ids.dtype)
    return weight[ids]  # [T, K]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` f32 ``[T, K]``, ``weight`` f32 ``[N, K]``, ``bias`` f32 ``[N]`` | None -> f32 ``[T, N]``."""
    assert weight.dtype == torch.float32 and x.shape[1] == weight.shape[1], (weight.dtype, x.shape, weight.shape)
    return torch.nn.functional.linear(x, weight, bias)  # [T, N]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` f32 ``[T, K]``, ``weight`` ``[K]`` -> f32 ``[T, K]`` (Zhang & Sennrich 2019)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then RMSNorm: ``(rms_norm(x + residual), x + residual)``, f32 ``[T, K]`` each."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half rotation: ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32 ``[T, D/2]`` -> ``[T, H, D]``."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J interleaved pairs ``(2i, 2i + 1)`` (GGUF llama files): shapes as :func:`rope`."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, D/2] each
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """Causal paged attention; writes ``k``/``v`` at ``meta.slot_mapping`` first.

    ``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]``
    -> f32 ``[T, H, D]``. Uses torch's SDPA with an explicit bottom-right causal mask.
    """
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d)[meta.slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, hkv, d)[meta.slot_mapping] = v.to(v_cache.dtype)
    out = torch.empty_like(q)
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        blocks = meta.block_tables[s, : -(-n_ctx // bs)]  # blocks in use
        ck = k_cache[blocks].reshape(-1, hkv, d)[:n_ctx].float()  # [L, Hkv, D]
        cv = v_cache[blocks].reshape(-1, hkv, d)[:n_ctx].float()
        group = q.shape[1] // hkv
        ck, cv = ck.repeat_interleave(group, dim=1), cv.repeat_interleave(group, dim=1)  # [L, H, D]
        # query i sits at position n_ctx - n_q + i and sees keys 0..that position
        mask = torch.arange(n_ctx)[None, :] <= torch.arange(n_ctx - n_q, n_ctx)[:, None]  # [Q, L]
        qs = q[start : start + n_q].transpose(0, 1)  # [H, Q, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ck.transpose(0, 1), cv.transpose(0, 1), attn_mask=mask, scale=meta.scale
        )  # [H, Q, D]
        out[start : start + n_q] = o.transpose(0, 1)
        start += n_q
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: f32 ``[T, N]`` x2 -> f32 ``[T, N]``."""
    return torch.nn.functional.silu(gate) * up
