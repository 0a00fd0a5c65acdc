"""Every kernel the CUDA and ROCm backends register, run as registered against the f32 reference.

This is the evidence behind the ``kernel-verified`` cells of COMPATIBILITY.md (the
``[[kernel]]`` entries of compat/verified.toml name these node IDs). The Triton kernels run
with the backend's own tuning under Triton's interpreter (``TRITON_INTERPRET=1``, set by
this folder's conftest); the torch kernels run on CPU tensors. Inputs and tolerances are
the conformance kit's (``zllm.conformance.cases``): what ``zllm conformance --backend cuda``
runs on a GPU, run here without one.
"""

from __future__ import annotations

import os

import pytest

from zllm.capabilities import Capability
from zllm.conformance.cases import cases_for
from zllm.conformance.kernels import run_case
from zllm.plugins.host import PluginHost
from zllm_backend_cuda.plugin import KERNELS as CUDA_KERNELS
from zllm_backend_rocm.plugin import KERNELS as ROCM_KERNELS
from zllm_kernels_torch.device import TorchDeviceBackend


class HostTensors(TorchDeviceBackend):
    """Where the kernels run here: CPU tensors (the Triton interpreter executes on them)."""

    name = "host"
    device_type = "cpu"

    @classmethod
    def device_count(cls) -> int:
        return 1


CASES = [(backend, Capability(op, v)) for backend, rows in (("cuda", CUDA_KERNELS), ("rocm", ROCM_KERNELS))
         for op, variants, _ in rows for v in variants]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost()


@pytest.mark.parametrize(("backend", "cap"), CASES, ids=[f"{b}-{c.op}-{c.variant}" for b, c in CASES])
def test_registered_kernel_matches_reference_without_a_device(host, backend, cap):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    kernel = host.kernels.lookup(cap.op, backend, cap.variant).fn
    reference = host.kernels.lookup(cap.op, backend, cap.variant, force_reference=True).fn
    cases = cases_for(cap.op, cap.variant, seed=0)
    assert cases, cap
    for case in cases:
        passed, max_abs, max_rel, detail = run_case(kernel, reference, case, HostTensors())
        assert passed, f"{cap} {case.label}: max abs {max_abs}, max rel {max_rel}; {detail}"
