"""A test-only op declared outside the core, with its reference, its case generator and two
plugins registering a kernel for it on the ``cpu`` backend: a correct one and a wrong one.

``SCALE`` is what a domain module would declare for a new op; the tests extend the core's op
table with it and check that the capability list, the reference registrations, binding and
the conformance kit all pick it up from this one declaration.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import OpDeclaration
from zllm.conformance.cases import Case
from zllm.plugin_api import hookimpl

ZLLM_PLUGIN_API = "1.0"

SCALE = OpDeclaration(
    name="test_scale", variants=("f32",), args=("x", "factor"),
    signature="(x f32 [T, K], factor float) -> f32 [T, K] = x * factor",
    reference="tests.conformance.scale_op_plugin:scale_reference",
    cases="tests.conformance.scale_op_plugin:scale_cases",
)


def scale_reference(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor``: ``x`` f32 ``[T, K]`` -> f32 ``[T, K]``."""
    return x * factor


def scale_cases(variant: str, g: torch.Generator, quick: bool) -> list[Case]:
    """Two ``test_scale[f32]`` cases (one with ``quick``)."""
    shapes = [(3, 5, 2.0), (7, 64, -0.5)][: 1 if quick else 2]
    return [Case("test_scale", variant, f"T={t} K={k} factor={f:g}", (torch.randn(t, k, generator=g), f))
            for t, k, f in shapes]


def scale_kernel(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.mul(x, factor)


def wrong_scale_kernel(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * (factor + 0.5)


class CorrectKernel:
    """Plugin registering :func:`scale_kernel` for ``test_scale[f32]`` on ``cpu``."""

    ZLLM_PLUGIN_API = ZLLM_PLUGIN_API

    @staticmethod
    @hookimpl
    def zllm_register_kernels(registry) -> None:
        registry.register("test_scale", "cpu", ("f32",), "tests.conformance.scale_op_plugin:scale_kernel",
                          registered_by="zllm-test-scale")


class WrongKernel:
    """Plugin registering :func:`wrong_scale_kernel` for ``test_scale[f32]`` on ``cpu``."""

    ZLLM_PLUGIN_API = ZLLM_PLUGIN_API

    @staticmethod
    @hookimpl
    def zllm_register_kernels(registry) -> None:
        registry.register("test_scale", "cpu", ("f32",), "tests.conformance.scale_op_plugin:wrong_scale_kernel",
                          registered_by="zllm-test-scale")
