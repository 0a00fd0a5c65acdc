"""Kernels bound for one model on one backend: the ``ops`` object a family's layers call.

Binding happens once at load: every needed capability is looked up in the registry, so a
missing kernel fails before the first forward, and each choice keeps its reason for
``zllm run --explain``. Weight ops dispatch on the weight's format with one dict lookup.

In batch-invariant mode (config ``runtime.batch_invariant``) every capability is bound to a
kernel its backend registered as batch-invariant (see :mod:`zllm.kernels.registry`); a
capability without one fails the load with :class:`~zllm.spec.errors.KernelNotFound`
naming the op and the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import torch

from zllm.capabilities import Capability
from zllm.kernels.registry import KernelChoice, KernelRegistry
from zllm.spec.errors import ConfigError, PluginError, ZllmError
from zllm.weights.formats import format_of

WEIGHT_OPS = ("embedding", "linear")


@attrs.frozen
class Explained:
    """One line of ``--explain``: the capability, the kernel chosen and why."""

    capability: str
    kernel: str
    reason: str


class BoundOps:
    """Callable kernels for a fixed set of capabilities on one backend.

    Args:
        registry: the host's kernel registry.
        backend: backend name.
        needed: the capabilities the model needs (from its family).
        force_reference: op names whose f32 reference must be used (config
            ``backend.force_reference``).
        batch_invariant: bind only batch-invariant kernels (config ``runtime.batch_invariant``).

    Raises:
        ConfigError: ``force_reference`` names an op the model does not use.
        KernelNotFound: a needed capability has no kernel on the backend (with
            ``batch_invariant``: no batch-invariant kernel).
        PluginError: the chosen kernel's ``module:function`` fails to import.
    """

    def __init__(self, registry: KernelRegistry, backend: str, needed: Iterable[Capability], force_reference: Iterable[str] = (),
                 batch_invariant: bool = False):
        needed = sorted(set(needed))
        forced = set(force_reference)
        ops_used = {c.op for c in needed}
        unknown = sorted(forced - ops_used)
        if unknown:
            raise ConfigError(
                "backend.force_reference",
                f"unknown op(s) {', '.join(unknown)}; this model's ops are {', '.join(sorted(ops_used))}",
            )
        self.choices: dict[Capability, KernelChoice] = {
            c: _lookup(registry, c, backend, c.op in forced, batch_invariant) for c in needed
        }
        self._by_format: dict[str, dict[str, Callable]] = {op: {} for op in WEIGHT_OPS}
        for cap, choice in self.choices.items():
            if cap.op in WEIGHT_OPS:
                self._by_format[cap.op][cap.variant] = choice.fn
            else:
                setattr(self, cap.op, choice.fn)

    def explain(self) -> list[Explained]:
        return [Explained(str(c), ch.entry.name, ch.reason) for c, ch in sorted(self.choices.items())]

    def embedding(self, weight, ids: torch.Tensor) -> torch.Tensor:
        return self._by_format["embedding"][format_of(weight)](weight, ids)

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._by_format["linear"][format_of(weight)](x, weight, bias)


def _lookup(registry: KernelRegistry, cap: Capability, backend: str, force_reference: bool,
            batch_invariant: bool) -> KernelChoice:
    """``registry.lookup`` for one capability; a kernel whose lazy reference fails to import is
    a plugin error naming it, not a traceback."""
    try:
        return registry.lookup(cap.op, backend, cap.variant, force_reference=force_reference,
                               batch_invariant=batch_invariant)
    except ZllmError:
        raise
    except Exception as exc:  # ImportError, AttributeError or whatever the kernel module raises on import
        raise PluginError(f"backend {backend!r}: the kernel for {cap} failed to import: "
                          f"{type(exc).__name__}: {exc}") from None
