"""The native MoE kernel (``csrc/moe.c``) for a given routing: the sum over each token's slots
computed expert by expert with the f32 reference, whatever the ids (repeated, unselected),
the formats of the six matrices and the shared expert; the same bits whatever the thread
count, whatever else is in the call and however a prefill is cut into calls; a bad id
poisons the output instead of reading outside the weights. Routing through the core's
router and the conformance cases are in test_cpu_moe.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance.cases import make_expert_stack
from zllm.domain.moe import SharedExperts, swiglu_ffn
from zllm_backend_cpu.kernels import GEMV_FORMATS
from zllm_backend_cpu.kernels.native import unavailable_reason

if unavailable_reason() is not None:  # the kernel modules bind the library's entry points at import
    pytest.skip(f"native library: {unavailable_reason()}", allow_module_level=True)

from zllm_backend_cpu.kernels import moe_gemv  # noqa: E402
from zllm_backend_cpu.kernels.moe_gemv import moe_experts  # noqa: E402

HIDDEN, WIDTH, SHARED_WIDTH = 64, 32, 96
KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # rows of 256: their own case below


def _shared(g: torch.Generator, fmt: str, hidden: int, width: int) -> SharedExperts:
    gate, up = (make_expert_stack(g, fmt, 1, width, hidden)[0] for _ in range(2))
    return SharedExperts(gate, up, make_expert_stack(g, fmt, 1, hidden, width)[0])


def one_by_one(x, ids, weights, gate, up, down, shared=None, scale=None) -> torch.Tensor:
    """Each token's slots in order, one expert at a time through the f32 reference FFN."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[row, slot])
            out[row] += weights[row, slot] * swiglu_ffn(x[row : row + 1], gate[e], up[e], down[e])[0]
        if shared is not None:
            y = swiglu_ffn(x[row : row + 1], shared.gate_proj, shared.up_proj, shared.down_proj)[0]
            out[row] += y if scale is None else scale[row] * y
    return out


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 12),
    e=st.sampled_from([1, 3, 8]),
    top_k=st.integers(1, 4),
    formats=st.tuples(*[st.sampled_from([f for f in GEMV_FORMATS if f not in KQUANTS])] * 3),
    shared_fmt=st.sampled_from([None, "f32", "bf16", "q8_0", "q5_1"]),
    gated=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_each_token_gets_its_slots_summed_expert_by_expert_even_with_repeated_ids(
    t, e, top_k, formats, shared_fmt, gated, seed
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g)
    ids = torch.randint(0, e, (t, top_k), generator=g)  # repeats and unselected experts alike
    weights = torch.rand(t, top_k, generator=g)
    gate = make_expert_stack(g, formats[0], e, WIDTH, HIDDEN)
    up = make_expert_stack(g, formats[1], e, WIDTH, HIDDEN)
    down = make_expert_stack(g, formats[2], e, HIDDEN, WIDTH)
    shared = None if shared_fmt is None else _shared(g, shared_fmt, HIDDEN, SHARED_WIDTH)
    scale = torch.rand(t, 1, generator=g) if shared is not None and gated else None

    out = moe_experts(x, ids, weights, gate, up, down, shared, scale)

    expected = one_by_one(x, ids, weights, gate, up, down, shared, scale)
    # dense: f32 products; block formats: x and h quantized to int16 per block (~1e-5 relative)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


@settings(max_examples=10, deadline=None)
@given(
    t=st.sampled_from([1, 1, 3, 9]),
    top_k=st.integers(1, 3),
    formats=st.tuples(*[st.sampled_from(KQUANTS)] * 3),
    shared_fmt=st.sampled_from([None, "q6_k", "q8_0"]),
    seed=st.integers(0, 2**16),
)
def test_kquant_experts_are_summed_expert_by_expert_within_the_int16_activation_bound(t, top_k, formats, shared_fmt,
                                                                                     seed):
    # Q4_K_M / Q5_K_M files mix k-quants (down in Q6_K) and 32-blocks (widths not a multiple of 256)
    g = torch.Generator().manual_seed(seed)
    hidden, width, e = 256, 256, 4
    x = torch.randn(t, hidden, generator=g)
    ids = torch.randint(0, e, (t, top_k), generator=g)
    weights = torch.rand(t, top_k, generator=g)
    gate = make_expert_stack(g, formats[0], e, width, hidden)
    up = make_expert_stack(g, formats[1], e, width, hidden)
    down = make_expert_stack(g, formats[2], e, hidden, width)
    shared = None if shared_fmt is None else _shared(g, shared_fmt, hidden, 256)
    scale = None if shared is None else torch.rand(t, 1, generator=g)
    assert moe_gemv.native_formats(gate, up, down, shared)

    out = moe_experts(x, ids, weights, gate, up, down, shared, scale)

    # x and h quantized to int16 per block of 32: ~1e-5 relative of each product (test_cpu_gemv.py
    # checks the per-product bound); outputs here are O(0.1)
    torch.testing.assert_close(out, one_by_one(x, ids, weights, gate, up, down, shared, scale), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("fmt", ["bf16", "q4_1", "q4_k"])
def test_a_row_has_the_same_bits_alone_in_a_batch_in_chunks_and_with_any_thread_count(fmt, monkeypatch):
    # experts large enough (~0.5-1 MiB each) that the kernel splits the work over the threads
    g = torch.Generator().manual_seed(1)
    hidden, width, t = 256, 512, 9
    gate, up = (make_expert_stack(g, fmt, 4, width, hidden) for _ in range(2))
    down = make_expert_stack(g, fmt, 4, hidden, width)
    shared = _shared(g, fmt, hidden, 256)
    x, weights = torch.randn(t, hidden, generator=g), torch.rand(t, 2, generator=g)
    ids = torch.randint(0, 4, (t, 2), generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = moe_experts(x, ids, weights, gate, up, down, shared)
        torch.set_num_threads(1)
        single = moe_experts(x, ids, weights, gate, up, down, shared)
    finally:
        torch.set_num_threads(threads)

    monkeypatch.setattr(moe_gemv, "MOE_CHUNK_TOKENS", 4)
    chunked = moe_experts(x, ids, weights, gate, up, down, shared)

    assert torch.equal(batch, single)
    assert torch.equal(batch, chunked)
    for row in (0, 4, t - 1):
        alone = moe_experts(x[row : row + 1], ids[row : row + 1], weights[row : row + 1], gate, up, down, shared)
        assert torch.equal(alone[0], batch[row]), row
    torch.testing.assert_close(batch, one_by_one(x, ids, weights, gate, up, down, shared), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_an_expert_id_outside_the_stack_makes_the_output_nan_instead_of_reading_past_it(bad_id):
    g = torch.Generator().manual_seed(2)
    stacks = [make_expert_stack(g, "q8_0", 4, WIDTH, HIDDEN) for _ in range(2)]
    stacks.append(make_expert_stack(g, "q8_0", 4, HIDDEN, WIDTH))
    ids = torch.tensor([[0, 1], [2, bad_id]])

    out = moe_experts(torch.randn(2, HIDDEN, generator=g), ids, torch.ones(2, 2), *stacks)

    assert bool(out.isnan().all())


def test_a_gate_stack_called_again_with_other_weights_uses_those_weights(monkeypatch):
    # The layer's weight descriptor is remembered per gate stack; the other five weights decide
    # whether it still applies.
    g = torch.Generator().manual_seed(4)
    gate = make_expert_stack(g, "q8_0", 4, WIDTH, HIDDEN)
    ups = [make_expert_stack(g, "q8_0", 4, WIDTH, HIDDEN), make_expert_stack(g, "f32", 4, WIDTH, HIDDEN)]
    downs = [make_expert_stack(g, "q8_0", 4, HIDDEN, WIDTH), make_expert_stack(g, "bf16", 4, HIDDEN, WIDTH)]
    shareds = [None, _shared(g, "q8_0", HIDDEN, SHARED_WIDTH)]
    # rows of a wider tensor, cut into calls of 4 tokens: each call's start is an address
    x = torch.randn(9, HIDDEN + 16, generator=g)[:, :HIDDEN]
    ids, weights = torch.randint(0, 4, (9, 2), generator=g), torch.rand(9, 2, generator=g)
    monkeypatch.setattr(moe_gemv, "MOE_CHUNK_TOKENS", 4)
    for up, down, shared in [(ups[0], downs[0], None), (ups[1], downs[0], None), (ups[1], downs[1], None),
                             (ups[1], downs[1], shareds[1]), (ups[0], downs[0], None)]:
        out = moe_experts(x, ids, weights, gate, up, down, shared)
        torch.testing.assert_close(out, one_by_one(x, ids, weights, gate, up, down, shared), atol=1e-3, rtol=1e-3)


def test_a_stack_without_unit_inner_stride_runs_from_a_copy_that_follows_its_writes():
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(4, HIDDEN, WIDTH, generator=g).transpose(1, 2)  # [E, N, K], inner stride N
    up = make_expert_stack(g, "f32", 4, WIDTH, HIDDEN)
    down = make_expert_stack(g, "f32", 4, HIDDEN, WIDTH)
    x, ids, weights = torch.randn(3, HIDDEN, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    before = moe_experts(x, ids, weights, gate, up, down)
    torch.testing.assert_close(before, one_by_one(x, ids, weights, gate, up, down), atol=1e-4, rtol=1e-4)
    gate.mul_(2)
    after = moe_experts(x, ids, weights, gate, up, down)
    torch.testing.assert_close(after, one_by_one(x, ids, weights, gate, up, down), atol=1e-4, rtol=1e-4)
