"""CPU ``moe`` kernels (torch, native GEMV, and their batch-invariant forms) vs the f32
reference: the conformance cases of every format, the sum over selected experts one by one,
unselected experts never read, and bit-identical rows whatever else is in the batch."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.conformance.cases import cases_for, make_expert_stack
from zllm.conformance.kernels import run_case
from zllm.domain.moe import RouterConfig, SharedExperts, moe, select_experts, swiglu_ffn
from zllm.weights.formats import QuantizedTensor
from zllm_backend_cpu.backend import CpuBackend
from zllm_backend_cpu.kernels import GEMV_FORMATS, QUANT_FORMATS
from zllm_backend_cpu.kernels.native import unavailable_reason

NATIVE_MISSING = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"native library: {unavailable_reason()}"
)
KERNELS = [
    ("moe", "moe"),
    ("moe", "moe_invariant"),
    pytest.param("moe_gemv", "moe_gemv", marks=NATIVE_MISSING),
    pytest.param("moe_gemv", "moe_gemv_invariant", marks=NATIVE_MISSING),
]
ALL = ("f32", "f16", "bf16", *QUANT_FORMATS)


def kernel(module: str, name: str):
    return getattr(importlib.import_module(f"zllm_backend_cpu.kernels.{module}"), name)


def _kernel_formats() -> list:
    """Every (kernel, format) it is registered for; the invariant kernels on a few formats (they
    run the same code over other linear kernels, each tested in its own file)."""
    out = []
    for param in KERNELS:
        module, name = param.values if hasattr(param, "values") else param
        marks = getattr(param, "marks", ())
        formats = GEMV_FORMATS if module == "moe_gemv" else ALL
        if name.endswith("invariant"):
            formats = tuple(f for f in formats if f in ("f32", "bf16", "q8_0", "q4_k"))
        out += [pytest.param(module, name, fmt, marks=marks, id=f"{name}-{fmt}") for fmt in formats]
    return out


@pytest.mark.parametrize("module, name, fmt", _kernel_formats())
def test_moe_kernel_matches_the_reference_on_every_conformance_case(module, name, fmt):
    fn, backend = kernel(module, name), CpuBackend()
    for case in cases_for("moe", fmt, seed=3, quick=fmt != "f32"):
        passed, max_abs, _, detail = run_case(fn, moe, case, backend)
        assert passed, f"{case.label}: {detail}"
        if fmt == "f32":
            assert max_abs < 1e-4, case.label  # the same f32 weights: only summation order differs


@pytest.mark.parametrize("module, name", KERNELS)
@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(1, 20),
    e=st.sampled_from([2, 4, 8]),
    top_k=st.integers(1, 4),
    grouped=st.booleans(),
    tied=st.booleans(),
    fmt=st.sampled_from(["f32", "bf16", "q8_0", "q4_0"]),
    seed=st.integers(0, 2**16),
)
def test_each_token_gets_the_sum_of_its_selected_experts_computed_one_by_one(
    module, name, t, e, top_k, grouped, tied, fmt, seed
):
    top_k = min(top_k, e)
    router = (
        RouterConfig(e, top_k, topk_method="group_limited_greedy", n_group=2, topk_group=2)
        if grouped and e >= 4
        else RouterConfig(e, top_k, norm_topk_prob=True)
    )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=g)
    logits = (
        torch.randint(-1, 2, (t, e), generator=g).float()
        if tied
        else torch.randn(t, e, generator=g)
    )
    gate, up = (make_expert_stack(g, fmt, e, 32, 64) for _ in range(2))
    down = make_expert_stack(g, fmt, e, 64, 32)

    out = kernel(module, name)(x, logits, router, gate, up, down)

    routing = select_experts(logits, router)
    for row in range(t):
        expected = torch.zeros(64)
        for slot in range(top_k):
            expert = int(routing.topk_ids[row, slot])
            y = swiglu_ffn(x[row : row + 1], gate[expert], up[expert], down[expert])[0]
            expected += routing.topk_weights[row, slot] * y
        torch.testing.assert_close(
            out[row], expected, atol=1e-2, rtol=1e-2
        )  # bf16 decode rounds in bf16


def _poison(stack: torch.Tensor | QuantizedTensor, experts: list[int]) -> None:
    """NaN weights in ``experts`` of ``stack`` (q8_0: an f16 NaN block scale)."""
    for expert in experts:
        if isinstance(stack, QuantizedTensor):
            stack.data[expert].view(stack.shape[1], -1, 34)[..., :2] = torch.tensor(
                [0x7E00], dtype=torch.int16
            ).view(torch.uint8)
        else:
            stack[expert] = float("nan")


@pytest.mark.parametrize("module, name", KERNELS)
@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
def test_experts_no_token_selected_are_never_read(module, name, fmt):
    g = torch.Generator().manual_seed(0)
    router = RouterConfig(8, 2)
    logits = torch.full((3, 8), -5.0)
    logits[:, 1], logits[:, 6] = 3.0, 2.0  # every token picks experts 1 and 6
    stacks = [
        make_expert_stack(g, fmt, 8, 32, 64),
        make_expert_stack(g, fmt, 8, 32, 64),
        make_expert_stack(g, fmt, 8, 64, 32),
    ]
    x = torch.randn(3, 64, generator=g)
    clean = moe(x, logits, router, *stacks)
    for stack in stacks:
        _poison(stack, [0, 2, 3, 4, 5, 7])

    out = kernel(module, name)(x, logits, router, *stacks)

    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, clean, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("module, name", [KERNELS[1], KERNELS[3]])
@settings(max_examples=10, deadline=None)
@given(
    t=st.integers(2, 40),
    sigmoid=st.booleans(),
    fmt=st.sampled_from(["f32", "bf16", "q8_0", "q4_k"]),
    seed=st.integers(0, 2**16),
)
def test_invariant_moe_rows_are_bit_identical_whatever_else_is_in_the_batch(
    module, name, t, sigmoid, fmt, seed
):
    if module == "moe_gemv" and fmt not in GEMV_FORMATS:
        return
    g = torch.Generator().manual_seed(seed)
    hidden, width = (256, 256) if fmt == "q4_k" else (64, 32)
    router = (
        RouterConfig(
            8,
            2,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
        )
        if sigmoid
        else RouterConfig(8, 2)
    )
    bias = torch.randn(8, generator=g) * 0.1 if sigmoid else None
    stacks = [
        make_expert_stack(g, fmt, 8, width, hidden),
        make_expert_stack(g, fmt, 8, width, hidden),
        make_expert_stack(g, fmt, 8, hidden, width),
    ]
    shared = SharedExperts(
        *(
            make_expert_stack(g, fmt, 1, *s)[0]
            for s in ((width, hidden), (width, hidden), (hidden, width))
        ),
        torch.randn(1, hidden, generator=g),
    )
    x, logits = torch.randn(t, hidden, generator=g), torch.randn(t, 8, generator=g)
    fn = kernel(module, name)

    batch = fn(x, logits, router, *stacks, bias, shared)
    for row in (0, t // 2, t - 1):
        alone = fn(x[row : row + 1], logits[row : row + 1], router, *stacks, bias, shared)
        assert torch.equal(batch[row], alone[0]), row
