"""gpt-oss's expert FFN (``moe_clamped_swiglu``: clamped SwiGLU, gate / up / down biases) in the
native MoE kernel (``csrc/moe.c``), and the HF kernel layouts there (also for ``moe``): within
the f32 reference's tolerance in every format the native GEMVs have, whichever row kernel a
shape takes; the same bits alone, in a batch, in chunks and with any thread count; an act-order
INT stack through the per-expert loop; a bias written in place seen by the next call."""

from __future__ import annotations

import pytest
import torch

from zllm.conformance.cases import make_expert_stack
from zllm.domain import moe_biased as reference
from zllm.domain.moe import SharedExperts, swiglu_ffn
from zllm.plugin_api import QuantizedTensor
from zllm_backend_cpu.kernels import GEMV_FORMATS, QUANT_GEMV_FORMATS
from zllm_backend_cpu.kernels.native import unavailable_reason

if unavailable_reason() is not None:  # the kernel modules bind the library's entry points at import
    pytest.skip(f"native library: {unavailable_reason()}", allow_module_level=True)

from zllm_backend_cpu.kernels import moe_biased, moe_gemv  # noqa: E402
from zllm_backend_cpu.kernels.moe_gemv import moe_clamped_swiglu_gemv, moe_experts  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's
KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
# GGUF block formats round x and h to int16 per block of 32 (~1e-5 relative per product); the
# dense formats and the HF layouts keep f32 activations (~1e-6)
BLOCK = tuple(f for f in GEMV_FORMATS if f not in ("f32", "f16", "bf16"))


def _case(fmt: str, t: int, e: int, top_k: int, hidden: int, width: int, seed: int, x_scale: float = 4.0):
    """A routing with repeated experts in a token's slots and unselected experts, pre-activations
    past the clamp limit on both sides (x times ``x_scale``), biases of gate / up / down."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g) * x_scale
    ids = torch.randint(0, e, (t, top_k), generator=g)
    weights = torch.rand(t, top_k, generator=g).softmax(dim=-1)
    gate = make_expert_stack(g, fmt, e, width, hidden)
    up = make_expert_stack(g, fmt, e, width, hidden)
    down = make_expert_stack(g, fmt, e, hidden, width)
    biases = (torch.randn(e, width, generator=g), torch.randn(e, width, generator=g),
              torch.randn(e, hidden, generator=g) * 0.1)
    return x, ids, weights, gate, up, down, biases


def _tolerance(fmt: str) -> dict[str, float]:
    return dict(atol=2e-3, rtol=2e-3) if fmt in BLOCK else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", [*GEMV_FORMATS, *QUANT_GEMV_FORMATS])
@pytest.mark.parametrize("t", [1, 5])
def test_clamped_swiglu_experts_match_the_reference_in_every_native_format(fmt, t):
    hidden, width = (256, 256) if fmt in KQUANTS else (128, 64)  # the HF nibble rows in 128-column chunks
    x, ids, weights, gate, up, down, biases = _case(fmt, t, 6, 3, hidden, width, seed=t)
    assert moe_gemv.native_formats(gate, up, down, None)

    out = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)

    expected = reference.moe_clamped_swiglu(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)
    torch.testing.assert_close(out, expected, **_tolerance(fmt))


@pytest.mark.parametrize("fmt", QUANT_GEMV_FORMATS)
def test_hf_layouts_whose_rows_are_not_in_128_column_chunks_match_the_reference(fmt):
    # gpt-oss's hidden size 2880 is no multiple of 128: x and h go to the rows unprepared
    x, ids, weights, gate, up, down, biases = _case(fmt, 3, 4, 2, 160, 96, seed=7)

    out = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)

    expected = reference.moe_clamped_swiglu(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_the_clamp_cuts_the_gate_from_above_and_up_on_both_sides():
    # one expert of width 1 whose gate and up rows pick single columns of x: the activation is
    # visible directly (down = 1, no biases)
    x = torch.tensor([[20.0, -20.0], [20.0, 3.0], [-3.0, -20.0]])  # [T, K]
    gate = torch.tensor([[[1.0, 0.0]]])  # [E, N, K]: gate = x[:, 0]
    up = torch.tensor([[[0.0, 1.0]]])  # up = x[:, 1]
    down = torch.ones(1, 2, 1)
    zeros = (torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 2))
    ids, weights = torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)

    out = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *zeros, ALPHA, LIMIT)

    c = torch.tensor([LIMIT, LIMIT, -3.0])
    u = torch.tensor([-LIMIT, 3.0, -LIMIT])
    expected = (u + 1) * c * torch.sigmoid(ALPHA * c)
    torch.testing.assert_close(out[:, 0], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["bf16", "q4_0", *QUANT_GEMV_FORMATS])
def test_a_row_has_the_same_bits_alone_in_a_batch_in_chunks_and_with_any_thread_count(fmt, monkeypatch):
    # experts large enough (~0.1-1 MiB each) that the kernel splits the work over the threads
    x, ids, weights, gate, up, down, biases = _case(fmt, 9, 4, 2, 256, 512, seed=3)

    def run(rows: slice = slice(None)) -> torch.Tensor:
        return moe_clamped_swiglu_gemv(x[rows], ids[rows], weights[rows], gate, up, down, *biases, ALPHA, LIMIT)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = run()
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(moe_gemv, "MOE_CHUNK_TOKENS", 4)
    chunked = run()

    assert torch.equal(batch, single)
    assert torch.equal(batch, chunked)
    for row in (0, 4, 8):
        assert torch.equal(run(slice(row, row + 1))[0], batch[row]), row
    expected = reference.moe_clamped_swiglu(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)
    torch.testing.assert_close(batch, expected, **_tolerance(fmt))


def test_an_act_order_int_stack_takes_the_per_expert_loop_and_matches_the_reference(monkeypatch):
    x, ids, weights, gate, up, down, biases = _case("int4_g", 3, 4, 2, 128, 64, seed=5)
    g = torch.Generator().manual_seed(11)
    perm = torch.stack([torch.randperm(128, generator=g) for _ in range(4)])  # [E, K]
    gate = QuantizedTensor({**gate.parts, "perm": perm}, "int4_g", tuple(gate.shape), block=gate.block)
    assert not moe_gemv.native_formats(gate, up, down, None)
    monkeypatch.setattr(moe_gemv, "moe_experts", None)  # the native call must not be reached

    out = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)

    expected = reference.moe_clamped_swiglu(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_a_bf16_bias_written_in_place_is_seen_by_the_next_call():
    x, ids, weights, gate, up, down, biases = _case("mxfp4", 2, 3, 2, 128, 64, seed=9)
    bf16 = tuple(b.bfloat16() for b in biases)
    first = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *bf16, ALPHA, LIMIT)

    bf16[2].add_(1.0)  # down's bias: every output moves by ~1 (the weights sum to 1; bf16 rounds the sum)
    second = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *bf16, ALPHA, LIMIT)

    torch.testing.assert_close(second - first, torch.ones_like(first), atol=2e-2, rtol=0)
    expected = reference.moe_clamped_swiglu(x, ids, weights, gate, up, down, *bf16, ALPHA, LIMIT)
    torch.testing.assert_close(second, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", QUANT_GEMV_FORMATS)
def test_the_silu_moe_takes_hf_layouts_natively_with_a_shared_expert_of_another_layout(fmt):
    g = torch.Generator().manual_seed(4)
    hidden, width, e, t = 128, 64, 5, 4
    x, ids = torch.randn(t, hidden, generator=g), torch.randint(0, e, (t, 2), generator=g)
    weights = torch.rand(t, 2, generator=g)
    gate, up = (make_expert_stack(g, fmt, e, width, hidden) for _ in range(2))
    down = make_expert_stack(g, fmt, e, hidden, width)
    other = "mxfp4" if fmt != "mxfp4" else "int8_g"
    shared_gate, shared_up = (make_expert_stack(g, other, 1, 96, hidden)[0] for _ in range(2))
    shared_down = make_expert_stack(g, other, 1, hidden, 96)[0]
    shared = SharedExperts(shared_gate, shared_up, shared_down)
    assert moe_gemv.native_formats(gate, up, down, shared)

    out = moe_experts(x, ids, weights, gate, up, down, shared)

    expected = torch.zeros_like(x)
    for row in range(t):
        for slot in range(2):
            expert = int(ids[row, slot])
            expected[row] += weights[row, slot] * swiglu_ffn(x[row:row + 1], gate[expert], up[expert],
                                                             down[expert])[0]
        expected[row] += swiglu_ffn(x[row:row + 1], shared_gate, shared_up, shared_down)[0]
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_the_native_kernel_and_the_per_expert_loop_agree_on_a_gpt_oss_shaped_layer():
    # the loop this kernel replaced: the same row kernels per expert, torch's sigmoid
    x, ids, weights, gate, up, down, biases = _case("mxfp4", 4, 8, 4, 256, 128, seed=12)

    native = moe_clamped_swiglu_gemv(x, ids, weights, gate, up, down, *biases, ALPHA, LIMIT)

    loop = moe_biased.run_experts(x, ids, weights, (gate, up, down), biases, ALPHA, LIMIT, moe_gemv._linear,
                                  moe_biased.swiglu_clamped)
    torch.testing.assert_close(native, loop, atol=1e-5, rtol=1e-5)
