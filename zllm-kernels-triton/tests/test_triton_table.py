"""The public API: ``kernel_table(Tuning())`` covers exactly the promised ops, every row runs
and registers under a readable name, ``Tuning`` rejects bad values, and importing the
package loads no Triton."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from triton_cases import build, random_q8_0

from zllm.conformance import quantizers
from zllm.conformance.cases import cases_for
from zllm.domain.activation import silu_mul as ref_silu_mul
from zllm.domain.attention import attention as ref_attention
from zllm.domain.attention import sliding_window_attention as ref_sliding
from zllm.domain.linear import linear as ref_linear
from zllm.domain.mla import mla_paged_attention as ref_mla
from zllm.domain.moe import moe as ref_moe
from zllm.domain.norm import add_rms_norm as ref_add_rms_norm
from zllm.domain.norm import rms_norm as ref_rms_norm
from zllm.domain.ops import CORE_OPS
from zllm.domain.rope import apply_rope, apply_rope_gptj
from zllm.kernels.registry import KernelRegistry
from zllm_kernels_triton import OPS, Tuning, kernel_table
from zllm_kernels_triton.moe import EXPERT_FORMATS
from zllm_kernels_triton.quant_hf import FORMAT_CODES
from zllm_kernels_triton.table import HF_FORMATS

EXPECTED = {
    ("rms_norm", "f32"), ("add_rms_norm", "f32"), ("rope", "neox"), ("rope", "gptj"), ("silu_mul", "f32"),
    ("attention", "paged"), ("attention_sliding", "paged"), ("linear", "q8_0"),
    ("moe", "f32"), ("moe", "f16"), ("moe", "bf16"), ("moe", "q8_0"), ("mla_attention", "paged"),
    *((op, fmt) for op in ("linear", "moe", "moe_clamped_swiglu")
      for fmt in ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")),
    ("attention_sinks", "paged"), ("swiglu_clamped", "f32"), ("router_topk_softmax", "f32"),
    ("moe_clamped_swiglu", "f32"), ("moe_clamped_swiglu", "f16"), ("moe_clamped_swiglu", "bf16"),
    ("moe_clamped_swiglu", "q8_0"),
}
#: Ops whose inputs come from the conformance kit's first quick case, checked against the
#: reference their declaration names.
KIT_OPS = ("attention_sinks", "swiglu_clamped", "router_topk_softmax", "moe_clamped_swiglu")


def _kit_inputs(op: str, variant: str):
    case = cases_for(op, variant, seed=0, quick=True)[0]
    module, _, name = CORE_OPS[op].reference_for(variant).partition(":")
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in case.args)
    return case.args, getattr(importlib.import_module(module), name)(*args)


def op_inputs(op: str, variant: str, g: torch.Generator):
    """Small inputs for one op and the reference's output on them (on cache copies for attention)."""
    x, residual, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    cos, sin, heads = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, 2, 16, generator=g)
    if op == "rms_norm":
        return (x, w, 1e-6), ref_rms_norm(x, w, 1e-6)
    if op == "add_rms_norm":
        return (x, residual, w, 1e-6), ref_add_rms_norm(x, residual, w, 1e-6)
    if op == "rope":
        return (heads, cos, sin), (apply_rope if variant == "neox" else apply_rope_gptj)(heads, cos, sin)
    if op == "silu_mul":
        return (x, residual), ref_silu_mul(x, residual)
    if op in KIT_OPS:
        return _kit_inputs(op, variant)
    if op in ("moe", "mla_attention"):
        case = cases_for(op, variant, seed=0, quick=True)[0]
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in case.args)
        return case.args, (ref_moe if op == "moe" else ref_mla)(*args)
    if op == "linear" and variant != "q8_0":
        wq = quantizers.quantize(torch.randn(5, 64, generator=g), variant)
        xq = torch.randn(3, 64, generator=g)
        return (xq, wq, None), ref_linear(xq, wq, None)
    if op == "linear":
        q8 = random_q8_0(5, 64, g)
        xq = torch.randn(3, 64, generator=g)
        return (xq, q8, None), ref_linear(xq, q8, None)
    q, k, v, k_cache, v_cache, meta = build(4, 2, 16, 4, [(3, 6), (1, 5)], torch.float16, 0)
    extra = (3,) if op == "attention_sliding" else ()
    ref = ref_sliding if extra else ref_attention
    return (q, k, v, k_cache, v_cache, meta, *extra), ref(q, k, v, k_cache.clone(), v_cache.clone(), meta, *extra)


def test_kernel_table_covers_exactly_the_promised_ops_once():
    rows = kernel_table(Tuning())
    pairs = [(op, variant) for op, variants, _ in rows for variant in variants]
    assert len(pairs) == len(set(pairs)) and set(pairs) == EXPECTED
    assert [(op, variants) for op, variants, _ in rows] == [(op, variants) for op, variants, _ in OPS]


def test_the_hf_formats_registered_are_the_ones_the_kernels_decode():
    assert tuple(FORMAT_CODES) == HF_FORMATS
    assert dict(((op, variants) for op, variants, _ in OPS if op == "moe")) == {"moe": EXPERT_FORMATS}


def test_every_row_runs_and_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    for op, variants, fn in kernel_table(Tuning()):
        args, expected = op_inputs(op, variants[0], g)
        torch.testing.assert_close(fn(*args), expected, atol=1e-4, rtol=1e-4, msg=lambda m, op=op: f"{op}: {m}")


def test_rows_register_under_names_that_show_module_function_and_tuning():
    registry = KernelRegistry()
    for op, variants, fn in kernel_table(Tuning(name="cuda-sm90")):
        registry.register(op, "cuda", variants, fn, registered_by="zllm-backend-cuda")
    choice = registry.lookup("rope", "cuda", "gptj")
    assert choice.entry.name == "zllm_kernels_triton.rope:rope_gptj[cuda-sm90]"
    assert (registry.lookup("linear", "cuda", "q8_0").entry.name
            == "zllm_kernels_triton.quant_matmul:linear_q8_0[cuda-sm90]")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prefill_block_m", 48, "power of two"),
    ("decode_block_n", 0, "power of two"),
    ("linear_block_k", 16, "multiple of the Q8_0 block"),
    ("norm_num_warps", 6, "power of two"),
    ("prefill_num_stages", 0, ">= 1"),
    ("dot_precision", "fast", "ieee, tf32, tf32x3"),
])
def test_tuning_rejects_invalid_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=rf"Tuning\.{field} = .*{message}"):
        Tuning(**{field: value})


def test_importing_the_package_loads_no_triton():
    code = "import sys, zllm_kernels_triton; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
