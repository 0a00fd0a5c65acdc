"""Native paged decode attention (csrc/attention.c via kernels/paged_attention.py) vs the f32 reference.

Batches as in test_cpu_attention.py (random block tables, new / append prefill and decode
mixed), with head dims that are not multiples of 8, contexts longer than one chunk of keys,
k/v as strided views into a fused QKV projection, and sliding windows whose earlier blocks
are freed (-1, NaN-poisoned). Decode rows run natively, prefill rows on the torch kernel;
both must match the reference, write the caches bit for bit as it does, leave q/k/v
unchanged, and give a decode row the same bits alone, in any batch and for any thread count.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_attention_sliding import drop_outside_window

from tests.paged_batches import paged_batch as build
from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import attention as ref_attention
from zllm.domain.attention import sliding_window_attention
from zllm_backend_cpu.kernels import paged_attention
from zllm_backend_cpu.kernels.paged_attention import attention, attention_sliding

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1), (6, 3)]  # MHA, GQA, GQA, MQA, GQA with odd G
DIMS = [8, 16, 64, 5, 12]
CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def paged_batch(draw, max_ctx: int = 150, kinds=("new", "append", "decode", "decode")):
    h, hkv = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from(DIMS))
    bs = draw(st.sampled_from([1, 3, 4, 16]))
    lens = []
    for _ in range(draw(st.integers(1, 5))):
        n_ctx = draw(st.integers(1, max_ctx))
        kind = draw(st.sampled_from(kinds))
        lens.append(({"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind], n_ctx))
    cache_dtype = draw(st.sampled_from(CACHE_DTYPES))
    return h, hkv, d, bs, lens, cache_dtype, draw(st.integers(0, 2**16)), draw(st.booleans())


def make(batch):
    *args, fused = batch
    return build(*args, fused_qkv=fused)


def run_and_compare(kernel, reference, q, k, v, k_cache, v_cache, meta):
    """Kernel and reference on copies of the caches: same writes, inputs unchanged; returns (got, expected)."""
    inputs = [x.clone() for x in (q, k, v)]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = reference(q, k, v, k_ref, v_ref, meta)
    got = kernel(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v), strict=True)), "an input was written"
    return got, expected


@settings(max_examples=60, deadline=None)
@given(paged_batch())
def test_mixed_batch_matches_reference_and_writes_the_same_cache(batch):
    got, expected = run_and_compare(attention, ref_attention, *make(batch))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(paged_batch(max_ctx=300, kinds=("decode",)))
def test_decode_only_batch_matches_reference(batch):
    got, expected = run_and_compare(attention, ref_attention, *make(batch))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(paged_batch(), st.integers(1, 80))
def test_sliding_window_matches_reference_without_reading_freed_blocks(batch, window):
    q, k, v, k_cache, v_cache, meta = make(batch)
    meta = drop_outside_window(k_cache, v_cache, meta, window)
    got, expected = run_and_compare(lambda *a: attention_sliding(*a, window),
                                    lambda *a: sliding_window_attention(*a, window), q, k, v, k_cache, v_cache, meta)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [0, 700])
def test_long_context_decode_matches_reference(cache_dtype, window):
    lens = [(1, 2500), (1, 1), (1, 1031)]
    q, k, v, k_cache, v_cache, meta = build(8, 2, 64, 16, lens, cache_dtype, 3)
    if window:
        meta = drop_outside_window(k_cache, v_cache, meta, window)
        got, expected = run_and_compare(lambda *a: attention_sliding(*a, window),
                                        lambda *a: sliding_window_attention(*a, window),
                                        q, k, v, k_cache, v_cache, meta)
    else:
        got, expected = run_and_compare(attention, ref_attention, q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def alone(q, k, v, meta: AttentionMetadata, s: int):
    """Sequence ``s`` (a decode row) as a batch of its own."""
    row = sum(meta.query_lens[:s])
    sub = AttentionMetadata(meta.slot_mapping[row : row + 1], meta.block_tables[s : s + 1], (1,),
                            (meta.context_lens[s],), meta.scale)
    return row, q[row : row + 1], k[row : row + 1], v[row : row + 1], sub


@settings(max_examples=30, deadline=None)
@given(paged_batch(), st.sampled_from([0, 1, 5, 40]))
def test_decode_row_is_bit_identical_alone_and_in_a_batch(batch, window):
    q, k, v, k_cache, v_cache, meta = make(batch)
    if window:
        meta = drop_outside_window(k_cache, v_cache, meta, window)
    kernel = (lambda *a: attention_sliding(*a, window)) if window else attention
    batched = kernel(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    for s, n_q in enumerate(meta.query_lens):
        if n_q == 1:
            row, *args = alone(q, k, v, meta, s)
            single = kernel(*args[:3], k_cache.clone(), v_cache.clone(), args[3])
            assert torch.equal(single[0], batched[row]), s


@settings(max_examples=20, deadline=None)
@given(paged_batch(kinds=("decode",)), st.sampled_from([0, 7]))
def test_one_and_two_threads_give_identical_bits(batch, window):
    q, k, v, k_cache, v_cache, meta = make(batch)
    if window:
        meta = drop_outside_window(k_cache, v_cache, meta, window)
    kernel = (lambda *a: attention_sliding(*a, window)) if window else attention
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, k_cache.clone(), v_cache.clone(), meta)
        torch.set_num_threads(2)
        two = kernel(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_kv_write_skips_padding_slots(cache_dtype):
    q, k, v, k_cache, v_cache, meta = build(4, 2, 12, 4, [(3, 7), (1, 5)], cache_dtype, 0, fused_qkv=True)
    slots = meta.slot_mapping.clone()
    slots[1] = -1  # padding
    k_before, v_before = k_cache.clone(), v_cache.clone()
    write, _ = paged_attention._KERNELS[cache_dtype]
    nb, bs, hkv, d = k_cache.shape
    write(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(), len(slots),
          hkv, d, k_cache.data_ptr(), v_cache.data_ptr(), nb * bs, 2)
    kept = slots >= 0
    k_flat, v_flat = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    assert torch.equal(k_flat[slots[kept]], k[kept].to(cache_dtype))
    assert torch.equal(v_flat[slots[kept]], v[kept].to(cache_dtype))
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[slots[kept]] = False
    assert torch.equal(k_flat[others], k_before.view(nb * bs, hkv, d)[others])
    assert torch.equal(v_flat[others], v_before.view(nb * bs, hkv, d)[others])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_kv_write_rounds_like_tensor_to(cache_dtype):
    # ties (bf16: low 16 bits 0x8000; f16: 0x1000 below the kept bits), overflow, subnormals, +-0, inf
    bits = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0x3F803000, 0x7F7FFFFF, 0x477FF000,
                         0x477FEFFF, 0x33800000, 0x33000001, 0x00000001, 0x80000000, 0x7F800000, 0xFF800000,
                         0x387FC000, 0x38800000], dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.randn(4096) * 1e3, torch.randn(4096) * 1e-6])
    d = 8 * 3 + 5  # vector part and tail
    values = values[: values.numel() // d * d].view(-1, 1, d)  # [T, 1, D]
    t = values.shape[0]
    k_cache = torch.zeros(t, 1, 1, d, dtype=cache_dtype)
    v_cache = torch.zeros(t, 1, 1, d, dtype=cache_dtype)
    meta = AttentionMetadata(torch.arange(t), torch.arange(t)[:, None], (t,), (t,), d**-0.5)
    write, _ = paged_attention._KERNELS[cache_dtype]
    write(values.data_ptr(), d, d, values.data_ptr(), d, d, meta.slot_mapping.data_ptr(), t, 1, d,
          k_cache.data_ptr(), v_cache.data_ptr(), t, 1)
    expected = values.to(cache_dtype).view(t, 1, 1, d)
    assert torch.equal(k_cache.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), expected.view(torch.int16))


def test_block_table_padding_inside_the_context_gives_nan_not_a_wild_read():
    q, k, v, k_cache, v_cache, meta = build(4, 2, 8, 4, [(1, 9), (1, 6)], torch.float32, 0)
    tables = meta.block_tables.clone()
    tables[0, 0] = -1  # sequence 0's first block missing
    bad = AttentionMetadata(meta.slot_mapping, tables, meta.query_lens, meta.context_lens, meta.scale)
    got = attention(q, k, v, k_cache, v_cache, bad)
    assert got[0].isnan().all() and not got[1].isnan().any()


def test_other_cache_dtypes_take_the_torch_kernel():
    q, k, v, k_cache, v_cache, meta = build(4, 2, 8, 4, [(1, 9), (3, 6)], torch.float64, 0)
    got, expected = run_and_compare(attention, ref_attention, q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_window_one_decode_returns_the_new_value():
    q, k, v, k_cache, v_cache, meta = build(4, 2, 16, 4, [(1, 9), (1, 1), (1, 30)], torch.float32, 5)
    meta = drop_outside_window(k_cache, v_cache, meta, 1)
    out = attention_sliding(q, k, v, k_cache, v_cache, meta, 1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("lens", [[(1, 9), (1, 20), (1, 3)], [(1, 9), (4, 20), (1, 3)]])
def test_layers_sharing_one_metadata_each_match_reference(lens):
    # every layer of a step gets the same metadata object with other q/k/v and caches
    meta = None
    for seed in range(3):
        q, k, v, k_cache, v_cache, m = build(4, 2, 16, 4, lens, torch.float32, seed)
        meta = meta or m
        got, expected = run_and_compare(attention, ref_attention, q, k, v, k_cache, v_cache, meta)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[(1, 3)], [(1, 2500), (1, 1031)]])
def test_small_calls_run_on_one_thread_and_large_ones_on_two_with_the_same_bits(lens):
    """Below ATTENTION_PARALLEL_MIN multiply-adds the call stays on one thread; either way the
    bits do not depend on the thread count."""
    q, k, v, k_cache, v_cache, meta = build(8, 2, 64, 16, lens, torch.float32, 5)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(attention(q, k, v, k_cache.clone(), v_cache.clone(), meta))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], ref_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta),
                               atol=1e-5, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(paged_batch(), st.sampled_from([None, 1, 7, 40]), st.sampled_from([0.0, 1.0, 8.0, -30.0]), st.integers(0, 99))
def test_sinks_match_reference_in_mixed_batches_and_sliding_windows(batch, window, sink_level, seed):
    """gpt-oss's sinks: decode rows natively (the sink joins the max and the denominator), the
    prefill rows on the torch kernel; sinks that dominate the scores (8) or vanish (-30) too."""
    from zllm.domain.attention_sinks import attention_sinks as ref_sinks
    from zllm_backend_cpu.kernels.paged_attention import attention_sinks

    q, k, v, k_cache, v_cache, meta = make(batch)
    if window is not None:
        meta = drop_outside_window(k_cache, v_cache, meta, window)
    sinks = sink_level + torch.randn(q.shape[1], generator=torch.Generator().manual_seed(seed))
    got, expected = run_and_compare(lambda *a: attention_sinks(*a, sinks, window),
                                    lambda *a: ref_sinks(*a, sinks, window), q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sinks_decode_row_is_the_same_alone_or_in_a_batch():
    from zllm_backend_cpu.kernels.paged_attention import attention_sinks

    q, k, v, k_cache, v_cache, meta = make((8, 2, 16, 4, [(1, 37), (1, 90), (1, 5)], torch.float16, 3, False))
    sinks = torch.randn(8)
    batch = attention_sinks(q, k, v, k_cache.clone(), v_cache.clone(), meta, sinks)
    alone = AttentionMetadata(meta.slot_mapping[1:2], meta.block_tables[1:2], (1,), (90,), meta.scale)
    row = attention_sinks(q[1:2], k[1:2], v[1:2], k_cache.clone(), v_cache.clone(), alone, sinks)
    assert torch.equal(batch[1:2], row)
