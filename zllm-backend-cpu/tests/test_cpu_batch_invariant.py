"""Batch-invariant CPU kernels (``runtime.batch_invariant``): every output row is bit-identical
whatever else is in the call — the row count, the row's position, the other rows' values —
and attention gives the same numbers however a sequence's queries were chunked.

Also pins the problem they solve: the plain f32 ``linear`` drifts with the row count.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.capabilities.ops import AttentionMetadata
from zllm.kernels.registry import KernelRegistry
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor
from zllm_backend_cpu import plugin
from zllm_backend_cpu.kernels import CAPABILITIES
from zllm_backend_cpu.kernels.invariant import (
    attention_invariant,
    attention_sliding_invariant,
    linear_dense_invariant,
    linear_quant_invariant,
    silu_mul_invariant,
)
from zllm_backend_cpu.kernels.native import unavailable_reason


def _weight(fmt: str, n: int, k: int, g: torch.Generator):
    if fmt in ("f32", "f16", "bf16"):
        dtype = getattr(torch, {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[fmt])
        return torch.randn(n, k, generator=g).to(dtype)
    layout = BLOCK_LAYOUTS[fmt]
    data = torch.randint(0, 256, (n, k // layout.block_size * layout.type_size), dtype=torch.uint8, generator=g)
    scales = data.view(n, -1, layout.type_size)[..., :2]  # 32-weight formats: a leading f16 scale per block
    scales.copy_(torch.full(scales.shape[:-1], 0.01, dtype=torch.float16).view(torch.uint8).view(scales.shape))
    if fmt in ("q4_1", "q5_1"):  # and an f16 min m after it: finite, so outputs are comparable
        mins = data.view(n, -1, layout.type_size)[..., 2:4]
        mins.copy_(torch.full(mins.shape[:-1], -0.08, dtype=torch.float16).view(torch.uint8).view(mins.shape))
    return QuantizedTensor(data, fmt, (n, k))


def test_plain_f32_linear_drifts_with_the_row_count():
    """The measured problem (issue 5): row 0 of ``x[:16] @ W^T`` is not row 0 of ``x[:1] @ W^T``."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1376, 512, generator=g), torch.randn(16, 512, generator=g)
    drift = (torch.nn.functional.linear(x, w)[0] - torch.nn.functional.linear(x[:1], w)[0]).abs().max().item()
    assert drift > 0  # ~2.5e-5 on x86 oneDNN/MKL; if a torch build ever stops drifting, this says so
    assert torch.equal(linear_dense_invariant(x, w, None)[0], linear_dense_invariant(x[:1], w, None)[0])


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]),
       n=st.sampled_from([7, 64, 172, 333]), k_blocks=st.integers(1, 12), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_invariant_linear_rows_are_bit_identical_for_every_row_count_and_position(fmt, n, k_blocks, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = 32 * k_blocks
    w = _weight(fmt, n, k, g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(40, k, generator=g)
    kernel = linear_quant_invariant if isinstance(w, QuantizedTensor) else linear_dense_invariant
    solo = torch.cat([kernel(x[i:i + 1], w, b) for i in range(40)])  # every row alone  [40, N]
    for t in list(range(1, 17)) + [17, 33, 40]:
        for off in range(0, 40 - t + 1, 3 if t < 17 else 7):  # each row lands at many positions
            assert torch.equal(kernel(x[off:off + t], w, b), solo[off:off + t]), (t, off)
    # the other rows' values do not matter either
    noisy = x.clone()
    noisy[1:] = torch.randn(39, k, generator=g) * 1e3
    assert torch.equal(kernel(noisy[:16], w, b)[0], solo[0])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_invariant_silu_mul_rows_are_bit_identical_for_every_row_count(n, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(40, n, generator=g) * 4, torch.randn(40, n, generator=g)
    solo = torch.cat([silu_mul_invariant(gate[i:i + 1], up[i:i + 1]) for i in range(40)])
    for t in range(1, 41, 3):
        for off in range(0, 40 - t + 1, 5):
            assert torch.equal(silu_mul_invariant(gate[off:off + t], up[off:off + t]), solo[off:off + t]), (t, off)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(solo, ref, rtol=1e-6, atol=1e-6)


def _run_chunked(kernel, chunks: list[int], h: int, hkv: int, d: int, bs: int, g: torch.Generator, **kw):
    """One sequence prefilled/decoded in ``chunks``; returns the concatenated outputs."""
    total = sum(chunks)
    nb = -(-total // bs) + 2
    k_cache, v_cache = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    perm = torch.randperm(nb, generator=g)[: -(-total // bs)]
    q_all, k_all, v_all = (torch.randn(total, x, d, generator=g) for x in (h, hkv, hkv))
    outs, done = [], 0
    table = perm[None, :].clone()
    for n in chunks:
        pos = torch.arange(done, done + n)
        slots = perm[pos // bs] * bs + pos % bs
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table, query_lens=(n,), context_lens=(done + n,),
                                 scale=d ** -0.5)
        outs.append(kernel(q_all[done:done + n], k_all[done:done + n], v_all[done:done + n], k_cache, v_cache, meta,
                           **kw))
        done += n
    return torch.cat(outs)


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]), d=st.sampled_from([8, 16]), bs=st.sampled_from([1, 4, 16]),
       chunks=st.lists(st.integers(1, 12), min_size=1, max_size=5), window=st.one_of(st.none(), st.integers(1, 20)),
       seed=st.integers(0, 2**16))
def test_invariant_attention_is_independent_of_chunking(heads, d, bs, chunks, window, seed):
    h, hkv = heads
    kernel = attention_invariant if window is None else attention_sliding_invariant
    kw = {} if window is None else {"window": window}
    chunked = _run_chunked(kernel, chunks, h, hkv, d, bs, torch.Generator().manual_seed(seed), **kw)
    one_by_one = _run_chunked(kernel, [1] * sum(chunks), h, hkv, d, bs, torch.Generator().manual_seed(seed), **kw)
    whole = _run_chunked(kernel, [sum(chunks)], h, hkv, d, bs, torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(chunked, one_by_one) and torch.equal(whole, one_by_one)


def test_every_cpu_capability_has_a_batch_invariant_kernel_and_mode_off_keeps_the_fast_one():
    reg = KernelRegistry()
    plugin.zllm_register_kernels(reg)
    for cap in CAPABILITIES:
        inv = reg.lookup(cap.op, "cpu", cap.variant, batch_invariant=True)
        assert inv.entry.batch_invariant and "batch-invariant" in inv.reason
        fast = reg.lookup(cap.op, "cpu", cap.variant)
        assert fast.entry.priority >= 0  # the invariant kernels sit below every fast one
    native = unavailable_reason() is None  # the native GEMV then serves every linear format
    fast, invariant = (reg.lookup("linear", "cpu", "q4_k", batch_invariant=b) for b in (False, True))
    assert fast.entry.name.endswith("gemv:linear_gemv" if native else "linear:linear_quant")
    assert invariant.entry.name.endswith("gemv:linear_gemv_invariant" if native else "invariant:linear_quant_invariant")
