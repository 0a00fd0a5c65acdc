"""The kit's case generators: one per core op, every variant, the coverage the kit promises,
deterministic from a seed, and inputs the f32 references accept."""

from __future__ import annotations

import pytest
import torch

from zllm.conformance.cases import NoCases, cases_for
from zllm.conformance.kernels import reference_args
from zllm.domain.ops import CORE_CAPABILITIES, CORE_OPS, register_references
from zllm.kernels.registry import KernelRegistry

CORE = sorted(CORE_CAPABILITIES)


def test_every_core_op_declares_a_case_generator_that_imports():
    assert {c.op for c in CORE} == set(CORE_OPS.names)
    for op in CORE_OPS.ops:
        module, _, attr = op.cases.partition(":")
        assert callable(getattr(__import__(module, fromlist=[attr]), attr)), op.cases


@pytest.mark.parametrize("cap", CORE, ids=str)
def test_every_core_capability_has_cases_the_reference_accepts(cap):
    registry = KernelRegistry()
    register_references(registry)
    ref = registry.lookup(cap.op, "any", cap.variant, force_reference=True).fn

    cases = cases_for(cap.op, cap.variant, seed=0, quick=True)

    assert cases and all((c.op, c.variant) == (cap.op, cap.variant) for c in cases)
    for case in cases:
        ref(*reference_args(case))  # the reference's own shape/dtype asserts hold


def test_same_seed_gives_the_same_inputs_and_another_seed_others():
    a, b, c = (cases_for("attention", "paged", seed=s) for s in (7, 7, 8))
    assert [x.label for x in a] == [x.label for x in b]
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x.args[0], y.args[0]) and not torch.equal(x.args[0], z.args[0])
        assert torch.equal(x.args[5].block_tables, y.args[5].block_tables)


def test_unknown_op_or_variant_raises_naming_it():
    with pytest.raises(NoCases, match="no case generator for op 'softcap': it is not declared"):
        cases_for("softcap", "f32", seed=0)
    with pytest.raises(NoCases, match=r"no case generator for rope\[yarn\]"):
        cases_for("rope", "yarn", seed=0)
    with pytest.raises(NoCases, match="unknown weight format 'fp8'"):
        cases_for("linear", "fp8", seed=0)


def test_attention_cases_cover_gqa_ratios_block_sizes_and_batch_kinds():
    cases = cases_for("attention", "paged", seed=0)
    labels = " ".join(c.label for c in cases)
    ratios = {c.args[0].shape[1] // c.args[1].shape[1] for c in cases}
    assert {1, 2, 4, 8} <= ratios and any(c.args[1].shape[1] == 1 for c in cases)  # MQA
    assert {1, 5, 16} <= {c.args[3].shape[1] for c in cases}
    for kind in ("new-prefill", "append-prefill", "decode", "decode+new-prefill"):
        assert kind in labels
    assert any(not c.args[0].is_contiguous() for c in cases)  # q/k/v views of a fused qkv


def test_sliding_cases_free_blocks_before_the_window():
    cases = cases_for("attention_sliding", "paged", seed=0)
    freed = [c for c in cases if bool((c.args[5].block_tables[:, 0] == -1).any())]
    assert freed, "no case has a freed (-1) block ahead of a live one"
    assert any(c.args[6] < c.args[3].shape[1] for c in cases)  # window shorter than a block


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q6_k", "bf16"])
def test_weight_cases_store_weights_in_the_variants_format(fmt):
    from zllm.weights.formats import format_of

    cases = cases_for("linear", fmt, seed=0)
    assert all(format_of(c.args[1]) == fmt for c in cases)
    assert any(c.args[0].shape[0] == 1 for c in cases)  # a decode row
    assert any(not c.args[0].is_contiguous() for c in cases)


def test_mla_cases_cover_block_sizes_batch_kinds_cache_dtypes_and_kv_b_formats():
    cases = cases_for("mla_attention", "paged", seed=0)
    labels = " ".join(c.label for c in cases)
    assert {1, 5, 16} <= {c.args[3].shape[1] for c in cases}
    for kind in ("new-prefill", "append-prefill", "decode", "decode+new-prefill+append-prefill"):
        assert kind in labels
    assert {torch.float32, torch.float16, torch.bfloat16} <= {c.args[3].dtype for c in cases}
    assert {"f32", "bf16", "q8_0"} <= {c.label.split("kv_b_proj=")[1].split()[0] for c in cases}
    assert all(not c.args[0].is_contiguous() for c in cases)  # q_nope/q_pe split from one query
    assert all(c.written == (3,) for c in cases)  # the latent cache, nothing else


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k"])
def test_moe_cases_cover_decode_batches_ties_groups_bias_and_shared_experts(fmt):
    from zllm.weights.formats import format_of

    cases = cases_for("moe", fmt, seed=0)
    routers = [c.args[2] for c in cases]
    assert all(format_of(c.args[3]) == fmt and c.args[3].shape[0] == c.args[2].num_experts for c in cases)
    assert {1} < {c.args[0].shape[0] for c in cases}  # decode rows and batches
    assert {r.topk_method for r in routers} == {"greedy", "group_limited_greedy", "noaux_tc"}
    assert {r.norm_topk_prob for r in routers} == {True, False}
    assert any(c.args[6] is not None for c in cases)  # a correction bias
    shared = [c.args[7] for c in cases if c.args[7] is not None]
    assert {s.shared_expert_gate is None for s in shared} == {True, False}
    tied = [c for c in cases if "tied" in c.label]
    assert tied and all(bool((c.args[1][0] == c.args[1][0, 0]).all()) for c in tied)  # a row of all-equal logits
    assert any(not c.args[0].is_contiguous() for c in cases)
