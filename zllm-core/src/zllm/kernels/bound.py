"""Kernels bound for one model on one backend: the ``ops`` object a family's layers call.

Binding happens once at load: every needed capability is looked up in the registry, so a
missing kernel fails before the first forward, and each choice keeps its reason for
``zllm run --explain``. What a bound op is follows from its
:class:`~zllm.capabilities.ops.OpDeclaration`:

- an op with a ``weight_arg`` (``linear``, ``embedding``) is one callable that dispatches
  on the format of that argument with one dict lookup; a format that was not bound raises
  :class:`~zllm.spec.errors.KernelNotFound`;
- any other op bound in one variant is its kernel itself, ``ops.rope``;
- an op bound in several variants (``rope[neox]`` and ``rope[gptj]``) is reached only
  through ``ops.variant("rope", "gptj")``: calling ``ops.rope`` raises
  :class:`~zllm.spec.errors.BoundOpError` naming the bound variants, never picking one.

In batch-invariant mode (config ``runtime.batch_invariant``) every capability is bound to a
kernel its backend registered as batch-invariant (see :mod:`zllm.kernels.registry`); a
capability without one fails the load with :class:`~zllm.spec.errors.KernelNotFound`
naming the op and the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from zllm.capabilities import Capability
from zllm.capabilities.ops import OpDeclaration, OpTable
from zllm.kernels.registry import KernelChoice, KernelRegistry
from zllm.spec.errors import BoundOpError, ConfigError, KernelNotFound, PluginError, ZllmError
from zllm.weights.formats import format_of


@attrs.frozen
class Explained:
    """One line of ``--explain``: the capability, the kernel chosen and why."""

    capability: str
    kernel: str
    reason: str


class BoundOps:
    """Callable kernels for a fixed set of capabilities on one backend.

    Every bound op is an attribute named after it (see the module docstring for what it is);
    :meth:`variant` returns the kernel of one ``(op, variant)``.

    Args:
        registry: the host's kernel registry.
        backend: backend name.
        needed: the capabilities the model needs (from its family).
        force_reference: op names whose f32 reference must be used (config
            ``backend.force_reference``).
        batch_invariant: bind only batch-invariant kernels (config ``runtime.batch_invariant``).
        ops: the op declarations (the host's ``ops``); every needed op must be declared.

    Raises:
        ConfigError: ``force_reference`` names an op the model does not use.
        KernelNotFound: a needed capability has no kernel on the backend (with
            ``batch_invariant``: no batch-invariant kernel).
        PluginError: the chosen kernel's ``module:function`` fails to import.
        KeyError: a needed op is not declared in ``ops`` (a family bug: names the op).
    """

    def __init__(self, registry: KernelRegistry, backend: str, needed: Iterable[Capability],
                 force_reference: Iterable[str] = (), batch_invariant: bool = False, *, ops: OpTable):
        needed = sorted(set(needed))
        forced = set(force_reference)
        ops_used = {c.op for c in needed}
        unknown = sorted(forced - ops_used)
        if unknown:
            raise ConfigError(
                "backend.force_reference",
                f"unknown op(s) {', '.join(unknown)}; this model's ops are {', '.join(sorted(ops_used))}",
            )
        self.backend = backend
        self.choices: dict[Capability, KernelChoice] = {
            c: _lookup(registry, c, backend, c.op in forced, batch_invariant) for c in needed
        }
        self._by_variant: dict[tuple[str, str], Callable] = {(c.op, c.variant): ch.fn for c, ch in self.choices.items()}
        for name in sorted(ops_used):
            kernels = {v: fn for (op, v), fn in self._by_variant.items() if op == name}
            setattr(self, name, self._bind(ops[name], kernels))

    def _bind(self, decl: OpDeclaration, kernels: dict[str, Callable]) -> Callable:
        if decl.weight_arg is not None:
            return _format_dispatch(decl, kernels, self.backend)
        if len(kernels) == 1:
            return next(iter(kernels.values()))
        return _several_variants(decl.name, sorted(kernels))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Reached only for an op this model did not bind (a family calling an op its
        ``required_capabilities`` left out): an error naming the op and the bound ones."""
        if name.startswith("__"):
            raise AttributeError(name)
        bound = sorted({op for op, _ in self.__dict__.get("_by_variant", {})})
        raise AttributeError(f"op {name!r} is not bound for this model (bound ops: {', '.join(bound) or 'none'})")

    def variant(self, op: str, variant: str) -> Callable:
        """The kernel bound for ``op[variant]``.

        Raises:
            BoundOpError: that capability was not bound for this model (names what is).
        """
        try:
            return self._by_variant[(op, variant)]
        except KeyError:
            bound = ", ".join(f"{o}[{v}]" for o, v in sorted(self._by_variant) if o == op) or "none"
            raise BoundOpError(
                f"{op}[{variant}] is not bound for this model (bound variants of {op}: {bound})"
            ) from None

    def explain(self) -> list[Explained]:
        return [Explained(str(c), ch.entry.name, ch.reason) for c, ch in sorted(self.choices.items())]


def _format_dispatch(decl: OpDeclaration, kernels: dict[str, Callable], backend: str) -> Callable:
    """``op(*args)`` running the kernel of ``format_of(args[weight index])``; left-out optional
    arguments are passed as None."""
    index = decl.args.index(decl.weight_arg)
    n_args = len(decl.args)
    name = decl.name

    def dispatch(*args: Any) -> Any:
        if len(args) < n_args:
            args = args + (None,) * (n_args - len(args))
        fmt = format_of(args[index])
        kernel = kernels.get(fmt)
        if kernel is None:
            raise KernelNotFound(name, backend, fmt, [f"{backend}/{f}" for f in sorted(kernels)])
        return kernel(*args)

    dispatch.__name__ = dispatch.__qualname__ = name
    return dispatch


def _several_variants(op: str, variants: list[str]) -> Callable:
    listed = ", ".join(f"{op}[{v}]" for v in variants)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise BoundOpError(f"{op} is bound in several variants ({listed}); call ops.variant({op!r}, variant) "
                           f"to say which one runs")

    refuse.__name__ = refuse.__qualname__ = op
    return refuse


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
