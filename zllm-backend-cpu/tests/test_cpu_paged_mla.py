"""Native MLA decode (csrc/mla.c via kernels/paged_mla.py) vs the f32 reference in both forms.

Batches of New / Append Prefill and decode rows over latent caches whose blocks are handed out
in random order (tests/paged_batches.py), f32/f16/bf16 caches, ``q_nope``/``q_pe`` as views of
one projected query, widths that are not multiples of 8, contexts longer than one chunk of
keys, ``kv_b_proj`` dense and quantized. Decode rows run natively, prefill rows on the torch
kernel; both must match the reference, write the cache bit for bit as it does, and give a
decode row the same bits alone, in any batch and for any thread count.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.paged_batches import paged_batch
from zllm.capabilities.ops import AttentionMetadata
from zllm.conformance.cases import cases_for, make_weight
from zllm.conformance.kernels import reference_args
from zllm.domain.mla import mla_paged_attention
from zllm.weights.formats import QuantizedTensor
from zllm_backend_cpu.kernels import paged_mla
from zllm_backend_cpu.kernels.paged_mla import absorbed_weights, mla_attention

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (H, Dn, Dr, Dv, R): tails in every width (Dn 5, W 20 + 4, Dv 12), one head, DeepSeek-like ratios
SHAPES = [
    (4, 16, 8, 16, 32),
    (3, 5, 4, 12, 20),
    (1, 32, 16, 32, 64),
    (8, 16, 8, 8, 24),
    (16, 8, 2, 8, 70),
]


def mla_batch(shape, bs: int, lens: list[tuple[int, int]], cache_dtype: torch.dtype, seed: int):
    """``(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)`` for ``lens = [(Q, L), ...]``:
    the layout of :func:`tests.paged_batches.paged_batch` with one ``W``-wide row per token."""
    h, dn, dr, dv, r = shape
    w = r + dr
    _, latent, _, cache, _, meta = paged_batch(1, 1, w, bs, lens, cache_dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = latent.shape[0]
    q_nope, q_pe = (
        torch.randn(t, h * (dn + dr), generator=g).view(t, h, dn + dr).split([dn, dr], dim=-1)
    )
    kv_b = torch.randn(h * (dn + dv), r, generator=g) / r**0.5
    meta = AttentionMetadata(
        meta.slot_mapping, meta.block_tables, meta.query_lens, meta.context_lens, (dn + dr) ** -0.5
    )
    return q_nope, q_pe, latent[:, 0], cache.view(cache.shape[0], bs, w), kv_b, meta


def run_and_compare(args):
    """The kernel and both reference forms on copies of the cache: the same cache contents
    afterwards, inputs unchanged; returns (got, expected by form)."""
    q_nope, q_pe, latent, cache, kv_b, meta = args
    inputs = [x.clone() for x in (q_nope, q_pe, latent)]
    expected = {}
    for form in ("absorbed", "expanded"):
        ref_cache = cache.clone()
        expected[form] = mla_paged_attention(q_nope, q_pe, latent, ref_cache, kv_b, meta, form=form)
    got = mla_attention(q_nope, q_pe, latent, cache, kv_b, meta)
    assert torch.equal(cache, ref_cache)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q_nope, q_pe, latent), strict=True)), (
        "an input was written"
    )
    return got, expected


@st.composite
def batches(draw, max_ctx: int = 120, kinds=("new", "append", "decode", "decode")):
    lens = []
    for _ in range(draw(st.integers(1, 5))):
        n_ctx = draw(st.integers(1, max_ctx))
        kind = draw(st.sampled_from(kinds))
        lens.append(
            ({"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind], n_ctx)
        )
    return (
        draw(st.sampled_from(SHAPES)),
        draw(st.sampled_from([1, 3, 5, 16])),
        lens,
        draw(st.sampled_from(CACHE_DTYPES)),
        draw(st.integers(0, 2**16)),
    )


def test_conformance_cases_match_both_reference_forms():
    for case in cases_for("mla_attention", "paged", seed=5):
        args = reference_args(case)
        got = mla_attention(*args)
        for form in ("absorbed", "expanded"):
            ref_args = reference_args(case)
            ref = mla_paged_attention(*ref_args, form=form)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=case.label)
            assert torch.equal(args[3], ref_args[3]), case.label


@settings(max_examples=50, deadline=None)
@given(batches())
def test_mixed_batch_matches_both_reference_forms_and_writes_the_same_cache(batch):
    got, expected = run_and_compare(mla_batch(*batch))
    for ref in expected.values():
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(batches(max_ctx=300, kinds=("decode",)))
def test_decode_only_batch_matches_both_reference_forms(batch):
    got, expected = run_and_compare(mla_batch(*batch))
    for ref in expected.values():
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_long_context_decode_matches_the_reference(cache_dtype):
    args = mla_batch((4, 32, 16, 32, 64), 16, [(1, 2500), (1, 1), (1, 1031)], cache_dtype, 3)
    got, expected = run_and_compare(args)
    for ref in expected.values():
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "int4_g", "mxfp4"])
def test_quantized_kv_b_proj_stays_quantized_and_matches_the_reference_on_its_decoded_weight(fmt):
    # 4 heads of Dn + Dv = 32 rows: the conformance FP8 blocks of 16 rows fall on the heads.
    q_nope, q_pe, latent, cache, _, meta = mla_batch(SHAPES[0], 5, [(1, 23), (4, 9), (1, 1)], torch.float32, 7)
    kv_b = make_weight(torch.Generator().manual_seed(8), fmt, 4 * 32, 32)
    assert isinstance(kv_b, QuantizedTensor)
    got, expected = run_and_compare((q_nope, q_pe, latent, cache, kv_b, meta))
    for ref in expected.values():
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert paged_mla._SPLITS.get(kv_b) is None  # no f32 W_UK / W_UV kept beside it


def alone(args, s: int):
    """Sequence ``s`` (a decode row) of the batch ``args`` as a batch of its own."""
    q_nope, q_pe, latent, _, _, meta = args
    row = sum(meta.query_lens[:s])
    sub = AttentionMetadata(
        meta.slot_mapping[row : row + 1],
        meta.block_tables[s : s + 1],
        (1,),
        (meta.context_lens[s],),
        meta.scale,
    )
    return row, (q_nope[row : row + 1], q_pe[row : row + 1], latent[row : row + 1], sub)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_decode_row_is_bit_identical_alone_and_in_any_batch(batch):
    args = mla_batch(*batch)
    q_nope, q_pe, latent, cache, kv_b, meta = args
    batched = mla_attention(q_nope, q_pe, latent, cache.clone(), kv_b, meta)
    for s, n_q in enumerate(meta.query_lens):
        if n_q == 1:
            row, (qn, qp, lat, sub) = alone(args, s)
            single = mla_attention(qn, qp, lat, cache.clone(), kv_b, sub)
            assert torch.equal(single[0], batched[row]), s


def with_threads(n: int, fn):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=15, deadline=None)
@given(batches(max_ctx=400, kinds=("decode",)), st.sampled_from([2, 3, 5]))
def test_thread_counts_give_identical_bits(batch, threads):
    shape, bs, lens, cache_dtype, seed = batch
    q_nope, q_pe, latent, cache, kv_b, meta = mla_batch(
        (16, 32, 16, 32, 64), bs, lens, cache_dtype, seed
    )

    def run():
        return mla_attention(q_nope, q_pe, latent, cache.clone(), kv_b, meta)

    # at these shapes every call is past the one-thread threshold, so the heads split into
    # groups by thread count and batch size
    assert torch.equal(with_threads(1, run), with_threads(threads, run))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_latent_write_skips_padding_slots_and_rounds_like_tensor_to(cache_dtype):
    w = 8 * 3 + 5  # vector part and tail
    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0x3F801000,
            0x3F803000,
            0x7F7FFFFF,
            0x477FF000,
            0x477FEFFF,
            0x33800000,
            0x33000001,
            0x00000001,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x387FC000,
            0x38800000,
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    values = torch.cat(
        [bits.view(torch.float32), torch.randn(2048) * 1e3, torch.randn(2048) * 1e-6]
    )
    latent = values[: values.numel() // w * w].view(-1, w)  # [T, W]
    t = latent.shape[0]
    cache = torch.zeros(t + 3, 1, w, dtype=cache_dtype)
    slots = torch.randperm(t + 3)[:t].clone()
    slots[1] = -1  # padding
    slots[2] = t + 3  # past the end
    write, _ = paged_mla._KERNELS[cache_dtype]
    write(latent.data_ptr(), w, slots.data_ptr(), t, w, cache.data_ptr(), t + 3, 2)
    flat = cache.view(t + 3, w)
    kept = (slots >= 0) & (slots < t + 3)
    assert torch.equal(
        flat[slots[kept]].view(torch.int8), latent[kept].to(cache_dtype).view(torch.int8)
    )
    others = torch.ones(t + 3, dtype=torch.bool)
    others[slots[kept]] = False
    assert not flat[others].any()


def test_block_table_entry_outside_the_cache_gives_nan_not_a_wild_read():
    q_nope, q_pe, latent, cache, kv_b, meta = mla_batch(
        SHAPES[0], 4, [(1, 9), (1, 6)], torch.float32, 0
    )
    tables = meta.block_tables.clone()
    tables[0, 1] = cache.shape[0]  # sequence 0's second block past the cache
    bad = AttentionMetadata(
        meta.slot_mapping, tables, meta.query_lens, meta.context_lens, meta.scale
    )
    got = mla_attention(q_nope, q_pe, latent, cache, kv_b, bad)
    assert got[0].isnan().all() and not got[1].isnan().any()


def test_other_cache_dtypes_take_the_torch_kernel():
    got, expected = run_and_compare(mla_batch(SHAPES[0], 4, [(1, 9), (3, 6)], torch.float64, 0))
    torch.testing.assert_close(got, expected["absorbed"], atol=1e-5, rtol=1e-5)


def test_absorbed_weights_are_split_once_and_again_after_an_in_place_write():
    kv_b = torch.randn(4 * (16 + 8), 32).to(torch.bfloat16)
    w_uk, w_uv_t = absorbed_weights(kv_b, 4, 16, 8, 32)
    assert w_uk.shape == (4, 16, 32) and w_uv_t.shape == (4, 32, 8) and w_uk.dtype == torch.float32
    split = kv_b.float().view(4, 24, 32)
    assert torch.equal(w_uk, split[:, :16]) and torch.equal(w_uv_t, split[:, 16:].transpose(1, 2))
    again = absorbed_weights(kv_b, 4, 16, 8, 32)
    assert again[0] is w_uk and again[1] is w_uv_t
    kv_b.mul_(2)
    fresh = absorbed_weights(kv_b, 4, 16, 8, 32)
    assert torch.equal(fresh[0], 2 * w_uk)
