"""The kernel table of zllm-kernels-torch and the row helpers the GPU backends build theirs with."""

from __future__ import annotations

import importlib

import pytest

from zllm.capabilities import Capability
from zllm.domain.ops import CORE_CAPABILITIES
from zllm.kernels.registry import KernelRegistry
from zllm_kernels_torch.table import (
    BF16_WEIGHT_CAPABILITIES,
    GPU_TORCH_CAPABILITIES,
    TORCH_KERNELS,
    capabilities,
    lazy_rows,
    named_kernels,
    register_rows,
    torch_rows,
)


def test_every_torch_kernel_resolves_to_a_callable_for_a_core_capability():
    for _op, _variants, impl in TORCH_KERNELS:
        module, _, attr = impl.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), impl
    assert capabilities(TORCH_KERNELS) <= CORE_CAPABILITIES
    assert {str(c) for c in capabilities(TORCH_KERNELS)} >= set(GPU_TORCH_CAPABILITIES) | set(BF16_WEIGHT_CAPABILITIES)


def test_torch_rows_give_one_row_per_capability_and_name_an_unknown_one():
    rows = torch_rows(["linear[bf16]", "embedding[f16]"])
    assert rows == [("linear", ("bf16",), "zllm_kernels_torch.linear:linear_dense"),
                    ("embedding", ("f16",), "zllm_kernels_torch.linear:embedding_dense")]
    with pytest.raises(KeyError, match=r"linear\[q4_0\]"):
        torch_rows(["linear[q4_0]"])


def test_lazy_rows_point_at_the_names_named_kernels_builds():
    def rms_norm(): ...
    def rope(): ...
    table = [("rms_norm", ("f32",), rms_norm), ("rope", ("neox", "gptj"), rope)]
    rows = lazy_rows("some.module", table)
    assert rows == [("rms_norm", ("f32",), "some.module:rms_norm_f32"), ("rope", ("neox",), "some.module:rope_neox"),
                    ("rope", ("gptj",), "some.module:rope_gptj")]
    built = named_kernels(table)
    assert {impl.partition(":")[2] for _, _, impl in rows} == set(built)
    assert built["rope_gptj"] is rope
    assert capabilities(rows) == {Capability("rms_norm", "f32"), Capability("rope", "neox"), Capability("rope", "gptj")}


def test_register_rows_registers_each_variant_and_refuses_a_second_claim():
    registry = KernelRegistry()
    register_rows(registry, "gpu", torch_rows(GPU_TORCH_CAPABILITIES), registered_by="test")
    assert all(registry.has(c.op, "gpu", c.variant) for c in map(Capability.parse, GPU_TORCH_CAPABILITIES))
    with pytest.raises(ValueError, match="already registered by test"):
        register_rows(registry, "gpu", torch_rows(["linear[f32]"]), registered_by="other")
