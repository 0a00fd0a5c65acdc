"""The core's op table: every :class:`~zllm.capabilities.ops.OpDeclaration` of the domain layer.

Each module of :mod:`zllm.domain` that holds an op's f32 reference declares the op beside it,
in a module-level ``OPS`` tuple. This module collects them, module by module in name order,
so adding an op is one declaration in one domain module: the capability list
(:data:`CORE_CAPABILITIES`), the references registered under the pseudo-backend
``reference`` (:func:`register_references`), the conformance cases and argument names and
the dispatch of bound ops all read :data:`CORE_OPS`. Two modules declaring one name raise at
import. A capability added here is absent from every backend until that backend declares it.
"""

from __future__ import annotations

import importlib
import pkgutil

import zllm.domain
from zllm.capabilities import Capability
from zllm.capabilities.ops import OpDeclaration, OpTable
from zllm.kernels.registry import REFERENCE_BACKEND, KernelRegistry


def collect_ops() -> OpTable:
    """The declarations in the ``OPS`` tuples of every :mod:`zllm.domain` module.

    Raises:
        ValueError: two declarations share a name, or an ``OPS`` entry is not an
            :class:`OpDeclaration` (names the module).
    """
    declared: list[OpDeclaration] = []
    for info in sorted(pkgutil.iter_modules(zllm.domain.__path__), key=lambda m: m.name):
        if info.name == "ops":
            continue
        module = importlib.import_module(f"zllm.domain.{info.name}")
        for op in getattr(module, "OPS", ()):
            if not isinstance(op, OpDeclaration):
                raise ValueError(f"zllm.domain.{info.name}.OPS holds {op!r}, not an OpDeclaration")
            declared.append(op)
    return OpTable(tuple(declared))


#: Every op the core declares.
CORE_OPS: OpTable = collect_ops()

#: Every capability the core knows: ``op[variant]`` of each declared op and variant. Kernel op
#: names equal capability op names.
CORE_CAPABILITIES: frozenset[Capability] = CORE_OPS.capabilities

#: Ops the core once declared and took back, each with what does its job now. A plugin
#: written for an older plugin API may still declare or need one: the plugin host drops
#: such a backend capability and its kernels with a warning, and a family's need of one
#: is met by the core (:func:`without_retired`), so the plugin keeps loading.
RETIRED_OPS: dict[str, str] = {
    "sample": "since plugin API 1.2 the runtime's sampler (zllm.runtime.sampler) samples every backend's logits",
}


def without_retired(capabilities: frozenset[Capability]) -> frozenset[Capability]:
    """``capabilities`` less those of :data:`RETIRED_OPS` (a family's needs, a backend's declaration)."""
    return frozenset(c for c in capabilities if c.op not in RETIRED_OPS)


def register_references(registry: KernelRegistry, ops: OpTable = CORE_OPS) -> None:
    """Register the f32 reference of every variant of every op in ``ops`` on ``registry``
    (backend ``reference``), as the lazy ``"module:function"`` its declaration names.

    Raises:
        ValueError: a reference is already registered (from :meth:`KernelRegistry.register`).
    """
    for op in ops.ops:
        for variant in op.variants:
            registry.register(op.name, REFERENCE_BACKEND, (variant,), op.reference_for(variant),
                              registered_by="zllm-core")
