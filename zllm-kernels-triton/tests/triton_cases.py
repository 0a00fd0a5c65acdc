"""Shared inputs for the kernel tests: interpreter-sized tunings, paged attention batches, Q8_0 weights.

A batch holds S sequences (New Prefill ``Q == L``, Append Prefill ``Q < L``, decode
``Q == 1``) whose earlier tokens sit in a paged cache behind a random block table with
spare garbage blocks, as in ``zllm-core/tests/domain/test_ref_attention.py``.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tests.paged_batches import paged_batch
from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import first_window_block
from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton import Tuning

HEADS = [(2, 2), (4, 4), (2, 1), (4, 2), (4, 1), (8, 2)]  # (H, Hkv): GQA ratios 1, 2, 4
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def small_tuning(block: int, **overrides) -> Tuning:
    """A :class:`Tuning` whose tiles are ``block`` wide (interpreter-sized; below the GPU's 16)."""
    fields = dict(
        name="test", dot_min=1, norm_block_k=block, rope_block_h=max(1, block // 4), rope_block_pairs=block,
        silu_block_n=block, kv_write_block_h=max(1, block // 8), decode_block_n=block, prefill_block_m=block,
        prefill_block_n=block, linear_block_m=block, linear_block_n=block, linear_block_k=32,
    )
    return Tuning(**{**fields, **overrides})


#: Tile choices: 4/8/16-wide tiles, and the GPU defaults (16-padded dots, 64-wide tiles).
TUNINGS = st.sampled_from(["4", "8", "16", "default"]).map(
    lambda b: Tuning() if b == "default" else small_tuning(int(b)))


@st.composite
def paged_batches(draw, max_seqs: int = 3, max_ctx: int = 13, decode_only: bool = False):
    """``(h, hkv, d, bs, lens, cache_dtype, seed)`` for :func:`build`; ``lens`` is ``[(Q, L)]``."""
    h, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([8, 16, 32]))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    lens = []
    for _ in range(draw(st.integers(1, max_seqs))):
        n_ctx = draw(st.integers(1, max_ctx))
        kind = "decode" if decode_only else draw(st.sampled_from(["new", "append", "decode"]))
        lens.append(({"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind], n_ctx))
    return h, hkv, d, bs, lens, draw(st.sampled_from(CACHE_DTYPES)), draw(st.integers(0, 2**16))


def build(h, hkv, d, bs, lens, cache_dtype, seed):
    """``(q, k, v, k_cache, v_cache, meta)``: the new tokens and caches holding the older ones.

    ``q``, ``k`` and ``v`` are strided views into one fused ``[T, (H + 2 Hkv) * D]``
    projection, as a model's QKV matmul produces them. For a bf16 cache the new ``k``/``v``
    are bf16-representable (:func:`bf16_representable`).
    """
    q, k, v, k_cache, v_cache, meta = paged_batch(h, hkv, d, bs, lens, cache_dtype, seed, fused_qkv=True)
    if cache_dtype == torch.bfloat16:
        bf16_representable(k), bf16_representable(v)
    return q, k, v, k_cache, v_cache, meta


def bf16_representable(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` in place to values bf16 holds exactly, and return it.

    The interpreter's f32 -> bf16 cast truncates instead of rounding to nearest even (as
    the GPU does), so values written to a bf16 cache under it are made exact first.
    """
    return x.copy_(x.to(torch.bfloat16).float())


def free_outside_window(k_cache, v_cache, meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """Mark every block before the window's first as freed: -1 in the table, NaN in the cache."""
    bs = k_cache.shape[1]
    tables = meta.block_tables.clone()
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        first = first_window_block(n_q, n_ctx, window, bs)
        k_cache[tables[s, :first]] = float("nan")
        v_cache[tables[s, :first]] = float("nan")
        tables[s, :first] = -1
    return AttentionMetadata(meta.slot_mapping, tables, meta.query_lens, meta.context_lens, meta.scale)


def random_q8_0(n: int, k: int, g: torch.Generator) -> QuantizedTensor:
    """Random int8 quants with f16 scales of both signs, sized so that rows of ``W`` are O(1) in norm."""
    raw = torch.randint(0, 256, (n, k // 32, 34), dtype=torch.uint8, generator=g)
    scales = torch.randn(n, k // 32, 1, generator=g) / (127 * k**0.5)
    raw[..., :2] = scales.half().view(torch.uint8)
    return QuantizedTensor(raw.view(n, -1), "q8_0", (n, k))
