"""``moe`` kernel (route, align, fused gate/up + SiLU-and-mul GEMM, down GEMM with the combine
weights, shared experts) vs the f32 reference ``zllm.domain.moe.moe``, in the interpreter.

Inputs: the conformance kit's ``moe`` cases per dense and Q8_0 format (decode T=1 through
T=33, tied router logits, grouped and biased routers, gated and ungated shared experts, a
column-sliced ``x``; for the HF checkpoints' formats the same cases run with the CUDA and ROCm
tunings in ``tests/backends/test_gpu_kernels_off_device.py``) and hypothesis-drawn shapes
(odd K and N for dense stacks, tiles of 4-16 pairs so blocks pad and experts span several
blocks; for the HF checkpoints' formats, several K steps and N tiles, FP8 blocks that cut
rows and columns unevenly, int groups of 16 and 32 with and without zero points, act-order
permutations of their own for each stack and expert, and gpt-oss's biased clamped SwiGLU).
Expert weights are decoded exactly as the reference decodes them and all math is f32, so the
differences are summation order: 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import random_q8_0, small_tuning

from zllm.conformance import quantizers
from zllm.conformance.cases import cases_for, make_expert_stack
from zllm.domain.moe import moe as ref_moe
from zllm.domain.moe_biased import moe_clamped_swiglu as ref_moe_clamped_swiglu
from zllm.plugin_api import QuantizedTensor, RouterConfig, SharedExperts
from zllm_kernels_triton.moe import align_block_size, moe
from zllm_kernels_triton.moe_biased import moe_clamped_swiglu
from zllm_kernels_triton.tuning import Tuning

FORMATS = ["f32", "f16", "bf16", "q8_0"]
HF_FORMATS = ["fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4"]


def moe_tuning(block_m: int, block_n: int = 8, block_k: int = 32) -> Tuning:
    return small_tuning(8, moe_block_m=block_m, moe_block_n=block_n, moe_block_k=block_k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_matches_reference_on_the_conformance_cases(fmt):
    for case in cases_for("moe", fmt, seed=1, quick=True):
        got = moe(*case.args, tuning=moe_tuning(8, 16))
        torch.testing.assert_close(got, ref_moe(*case.args), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, c=case: f"{c.label}: {m}")


def test_moe_default_tuning_on_tied_logits_and_grouped_routers():
    for case in cases_for("moe", "q8_0", seed=2)[2:5]:  # ties T=33, noaux_tc + shared, grouped + ties
        torch.testing.assert_close(moe(*case.args), ref_moe(*case.args), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, c=case: f"{c.label}: {m}")


@st.composite
def moe_shapes(draw):
    fmt = draw(st.sampled_from(FORMATS))
    e = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(e, 4)))
    hidden = 32 * draw(st.integers(1, 3)) if fmt == "q8_0" else draw(st.integers(1, 40))
    width = 32 * draw(st.integers(1, 2)) if fmt == "q8_0" else draw(st.integers(1, 24))
    return dict(fmt=fmt, e=e, k=k, t=draw(st.integers(1, 12)), hidden=hidden, width=width,
                block_m=draw(st.sampled_from([1, 2, 4, 16])), block_n=draw(st.sampled_from([4, 8, 16])),
                renorm=draw(st.booleans()), shared=draw(st.sampled_from(["none", "ungated", "gated"])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=8, deadline=None)
@given(moe_shapes())
def test_moe_matches_reference_over_drawn_shapes(s):
    g = torch.Generator().manual_seed(s["seed"])
    x = torch.randn(s["t"], s["hidden"], generator=g)
    logits = torch.randn(s["t"], s["e"], generator=g) * 2
    router = RouterConfig(s["e"], s["k"], norm_topk_prob=s["renorm"])
    gate, up = (make_expert_stack(g, s["fmt"], s["e"], s["width"], s["hidden"]) for _ in range(2))
    down = make_expert_stack(g, s["fmt"], s["e"], s["hidden"], s["width"])
    shared = None
    if s["shared"] != "none":
        one = [make_expert_stack(g, s["fmt"], 1, *dims) for dims in
               ((s["width"], s["hidden"]), (s["width"], s["hidden"]), (s["hidden"], s["width"]))]
        shared = SharedExperts(*(w[0] for w in one), torch.randn(1, s["hidden"], generator=g)
                               if s["shared"] == "gated" else None)
    args = (x, logits, router, gate, up, down, None, shared)
    got = moe(*args, tuning=moe_tuning(s["block_m"], s["block_n"]))
    torch.testing.assert_close(got, ref_moe(*args), atol=1e-4, rtol=1e-4)


def test_experts_no_token_selected_are_never_read():
    # Experts 0-5 hold NaN; the router logits send every token to experts 6 and 7 only.
    g = torch.Generator().manual_seed(3)
    stacks = [QuantizedTensor(torch.stack([random_q8_0(*shape, g).data for _ in range(8)]), "q8_0", (8, *shape))
              for shape in ((32, 64), (32, 64), (64, 32))]
    poisoned = []
    for st_ in stacks:
        data = st_.data.clone()
        data[:6, :, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # every scale f16 NaN
        poisoned.append(QuantizedTensor(data, "q8_0", st_.shape))
    x = torch.randn(5, 64, generator=g)
    logits = torch.full((5, 8), -10.0)
    logits[:, 6:] = torch.randn(5, 2, generator=g)
    router = RouterConfig(8, 2, norm_topk_prob=True)
    got = moe(x, logits, router, *poisoned, tuning=moe_tuning(4))
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref_moe(x, logits, router, *stacks), atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 20), e=st.integers(1, 10), k=st.integers(1, 4), block_m=st.sampled_from([1, 2, 4, 8, 16]),
       seed=st.integers(0, 2**16))
def test_align_block_size_buckets_every_pair_once_by_expert_with_per_block_padding(t, e, k, block_m, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (t, k), generator=g)
    pairs, block_experts = align_block_size(ids, e, block_m)
    n_pairs = t * k
    assert pairs.dtype == block_experts.dtype == torch.int32
    assert pairs.numel() == block_experts.numel() * block_m
    real = pairs[pairs < n_pairs].long()
    assert sorted(real.tolist()) == list(range(n_pairs))
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert block_experts.tolist() == sorted(block_experts.tolist())  # runs in expert order
    for blk, expert in enumerate(block_experts.tolist()):
        chunk = pairs[blk * block_m:(blk + 1) * block_m].long()
        chunk = chunk[chunk < n_pairs]
        assert (ids.flatten()[chunk] == expert).all() and chunk.tolist() == sorted(chunk.tolist())
    blocks = torch.bincount(block_experts.long(), minlength=e)
    assert torch.equal(blocks, (counts + block_m - 1) // block_m)  # unchosen experts: no block


def test_gate_up_and_down_stacks_may_each_have_their_own_format():
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(6, 64, generator=g), torch.randn(6, 4, generator=g)
    gate = make_expert_stack(g, "q8_0", 4, 32, 64)
    up = make_expert_stack(g, "f16", 4, 32, 64)
    down = make_expert_stack(g, "bf16", 4, 64, 32)
    shared = SharedExperts(make_expert_stack(g, "f16", 1, 32, 64)[0], make_expert_stack(g, "q8_0", 1, 32, 64)[0],
                           make_expert_stack(g, "q8_0", 1, 64, 32)[0])
    args = (x, logits, RouterConfig(4, 2), gate, up, down, None, shared)
    torch.testing.assert_close(moe(*args, tuning=moe_tuning(4)), ref_moe(*args), atol=1e-4, rtol=1e-4)


def hf_stack(g: torch.Generator, fmt: str, e: int, n: int, k: int, group: int, block: tuple[int, int],
             act_order: bool) -> QuantizedTensor:
    """``[E, N, K]`` in ``fmt``: FP8 in ``block``s, int groups of ``group`` (symmetric at 16),
    with act-order each expert gets its own random ``perm``."""
    experts = []
    for _ in range(e):
        w = torch.randn(n, k, generator=g) / k**0.5
        if fmt == "fp8_e4m3":
            q = quantizers.quantize_fp8_e4m3(w, block)
        elif fmt in ("int4_g", "int8_g"):
            q = quantizers.quantize_int_g(w, int(fmt[3]), group, symmetric=group == 16)
            if act_order:
                q = QuantizedTensor({**q.parts, "perm": torch.randperm(k, generator=g)}, fmt, q.shape, block=q.block)
        else:
            q = quantizers.quantize(w, fmt)
        experts.append(q)
    parts = {name: torch.stack([q.parts[name] for q in experts]) for name in experts[0].parts}
    return QuantizedTensor(parts, fmt, (e, n, k), block=experts[0].block)


@st.composite
def hf_moe_shapes(draw):
    return dict(fmt=draw(st.sampled_from(HF_FORMATS)), e=draw(st.integers(1, 4)), t=draw(st.integers(1, 6)),
                hidden=32 * draw(st.integers(1, 3)), width=32 * draw(st.integers(1, 2)),
                group=draw(st.sampled_from([16, 32])), block=draw(st.sampled_from([(1, 32), (7, 40), (5, 16)])),
                act_order=draw(st.booleans()), block_m=draw(st.sampled_from([4, 16])),
                block_n=draw(st.sampled_from([8, 16])), clamped=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=6, deadline=None)
@given(hf_moe_shapes())
def test_hf_format_experts_match_reference_over_drawn_blocks_groups_and_act_order(s):
    g = torch.Generator().manual_seed(s["seed"])
    e, t, hidden, width = s["e"], s["t"], s["hidden"], s["width"]
    quant = dict(group=s["group"], block=s["block"], act_order=s["act_order"])
    gate, up = (hf_stack(g, s["fmt"], e, width, hidden, **quant) for _ in range(2))
    down = hf_stack(g, s["fmt"], e, hidden, width, **quant)
    x = torch.randn(t, hidden, generator=g)
    tuning = moe_tuning(s["block_m"], s["block_n"])
    k = min(e, 2)
    if s["clamped"]:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k], distinct per row
        weights = torch.rand(t, k, generator=g).softmax(dim=-1)  # [T, k]
        biases = (torch.randn(e, width, generator=g), torch.randn(e, width, generator=g),
                  torch.randn(e, hidden, generator=g) * 0.1)
        args = (x, ids, weights, gate, up, down, *biases, 1.702, 7.0)
        got, expected = moe_clamped_swiglu(*args, tuning=tuning), ref_moe_clamped_swiglu(*args)
    else:
        args = (x, torch.randn(t, e, generator=g) * 2, RouterConfig(e, k), gate, up, down)
        got, expected = moe(*args, tuning=tuning), ref_moe(*args)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_gate_and_up_read_the_activations_each_through_its_own_act_order_permutation():
    # gate has act-order, up and down do not: the up GEMM must read x unpermuted
    g = torch.Generator().manual_seed(5)
    gate = hf_stack(g, "int4_g", 3, 32, 64, 32, (1, 32), act_order=True)
    up = hf_stack(g, "int4_g", 3, 32, 64, 32, (1, 32), act_order=False)
    down = hf_stack(g, "int8_g", 3, 64, 32, 16, (1, 16), act_order=True)
    args = (torch.randn(5, 64, generator=g), torch.randn(5, 3, generator=g), RouterConfig(3, 2), gate, up, down)
    torch.testing.assert_close(moe(*args, tuning=moe_tuning(4)), ref_moe(*args), atol=1e-4, rtol=1e-4)


def test_a_stack_in_a_format_the_kernels_do_not_decode_is_rejected_naming_it():
    g = torch.Generator().manual_seed(6)
    gate = make_expert_stack(g, "q4_k", 2, 32, 256)
    up = make_expert_stack(g, "mxfp4", 2, 32, 256)
    down = make_expert_stack(g, "mxfp4", 2, 256, 32)
    with pytest.raises(AssertionError, match="gate_exps: format 'q4_k' .*q8_0, fp8_e4m3, int4_g, int8_g, mxfp4, nvfp4"):
        moe(torch.randn(2, 256), torch.randn(2, 2), RouterConfig(2, 1), gate, up, down)

