"""Batch-invariant CPU kernels (config ``runtime.batch_invariant``): each output row (token) is
bit-identical whatever else is in the call — how many rows, where the row sits, what the
other rows hold, and for attention how a sequence's queries were split into chunks.

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features / width, ``RT`` rows of
a fixed row tile, ``H``/``Hkv`` query/KV heads, ``G = H / Hkv``, ``D`` head dim, ``L``
keys a query sees.

Why: a matmul's reduction order depends on the row count (oneDNN/MKL pick blockings per
shape), so f32 ``x[:1] @ W^T`` and ``x[:16] @ W^T`` differ in row 0 by up to ~5e-5
(``docs/server.md``, "Batch-invariant mode"); elementwise transcendental ops compute whole
SIMD vectors and a scalar tail with different libms; attention over a chunk of queries
blocks differently from one query at a time.

How:

- ``linear``: rows go through the backend's own ``linear`` kernel in tiles of exactly
  :data:`ROW_TILE` rows, zero-padded, so every call has the same shape; a GEMM's reduction
  order for an output element does not depend on the other rows' values, nor (checked for
  every position 0..15, by ``tests/test_invariant_kernels.py``) on the row's position.
  Where the native GEMV library loads, its kernels (batch-invariant for any row count, see
  :mod:`zllm_backend_cpu.kernels.gemv`) take precedence for f32/f16/bf16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1.
- ``silu_mul``: rows padded to a multiple of 64 and computed in calls of one fixed shape of
  at most 32768 elements (one thread), so every element is in a full SIMD vector.
- ``attention`` / ``attention_sliding``: every query token attends exactly as a decode step
  does — its own SDPA call over the keys it may see — so a prompt gives the same numbers
  whether it was prefilled whole, in chunks of any size, after a reused prefix, or
  recomputed after preemption.

``embedding``, ``rms_norm`` and ``rope`` are batch-invariant as they stand (gather; per-row
reductions; exact elementwise ``*``/``+``), and are registered as such by the kernel table.
Sampling is not a kernel: the runtime's sampler has its own batch-invariant mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zllm.plugin_api import AttentionMetadata, QuantizedTensor
from zllm_backend_cpu.kernels.attention import write_kv
from zllm_backend_cpu.kernels.linear import linear_dense, linear_quant

ROW_TILE = 16  # rows per linear call; 16 keeps a decode round of up to 16 sequences one GEMM
_ROW_CALL_ELEMENTS = 32768  # at::internal::GRAIN_SIZE: an elementwise call this small runs on one thread
_ROW_MULTIPLE = 64  # padded row width: no element falls in a scalar tail


def _tiled_rows(kernel, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    t, k = x.shape
    n = weight.shape[0]
    out = torch.empty(t, n)  # [T, N]
    tile = torch.zeros(ROW_TILE, k)  # [RT, K]
    for start in range(0, t, ROW_TILE):
        stop = min(t, start + ROW_TILE)
        tile[: stop - start] = x[start:stop]
        if stop - start < ROW_TILE:
            tile[stop - start:] = 0.0
        out[start:stop] = kernel(tile, weight, bias)[: stop - start]  # [RT, N] -> rows kept
    return out


def linear_dense_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`~zllm_backend_cpu.kernels.linear.linear_dense` over fixed ``[16, K]`` row tiles -> f32 ``[T, N]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    return _tiled_rows(linear_dense, x, weight, bias)


def linear_quant_invariant(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`~zllm_backend_cpu.kernels.linear.linear_quant` over fixed ``[16, K]`` row tiles -> f32 ``[T, N]``."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    return _tiled_rows(linear_quant, x, weight, bias)


def silu_mul_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with rows computed in fixed-shape, padded calls: f32 ``[T, N]`` -> f32 ``[T, N]``."""
    assert gate.dim() == 2 and gate.dtype == torch.float32 and up.shape == gate.shape, (
        gate.shape, gate.dtype, up.shape
    )
    t, n = gate.shape
    width = -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE
    rows = max(1, _ROW_CALL_ELEMENTS // width)
    buf = torch.zeros(rows, width)  # [R, N']
    out = torch.empty(t, n)
    for start in range(0, t, rows):
        stop = min(t, start + rows)
        buf[: stop - start, :n] = gate[start:stop]
        out[start:stop] = F.silu(buf)[: stop - start, :n]
    return out.mul_(up)  # an exact-rounded multiply: invariant as it stands


def _attend(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    h, d, bs, hkv = write_kv(q, k, v, k_cache, v_cache, meta)
    out = torch.empty_like(q)  # [T, H, D]
    start = 0
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        assert 0 < n_q <= n_ctx, (n_q, n_ctx)
        for pos in range(n_ctx - n_q, n_ctx):  # one query token at a time, as a decode step
            lo = 0 if window is None else max(0, pos - window + 1)  # first key it sees
            first, last = lo // bs, pos // bs  # blocks holding keys lo..pos
            blocks = meta.block_tables[s, first: last + 1]  # [nb']
            ks = k_cache[blocks].view(-1, hkv, d)[lo - first * bs: pos + 1 - first * bs]  # [L, Hkv, D], contiguous
            vs = v_cache[blocks].view(-1, hkv, d)[lo - first * bs: pos + 1 - first * bs]  # [L, Hkv, D]
            qs = q[start].view(hkv, h // hkv, d)  # [Hkv, G, D]
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).float(), vs.transpose(0, 1).float(),
                                               scale=meta.scale)  # [Hkv, G, D]
            out[start] = o.reshape(h, d)
            start += 1
    return out


def attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """As :func:`~zllm_backend_cpu.kernels.attention.attention`, each query token on its own:
    ``q`` f32 ``[T, H, D]``, ``k``/``v`` f32 ``[T, Hkv, D]``, caches ``[NB, BS, Hkv, D]`` -> f32 ``[T, H, D]``."""
    return _attend(q, k, v, k_cache, v_cache, meta, None)


def attention_sliding_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, meta: AttentionMetadata, window: int) -> torch.Tensor:
    """As :func:`~zllm_backend_cpu.kernels.attention.attention_sliding`, each query token on its
    own over exactly its ``window`` newest keys (no mask)."""
    assert window > 0, window
    return _attend(q, k, v, k_cache, v_cache, meta, window)
