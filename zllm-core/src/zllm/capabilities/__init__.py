"""Capabilities: what a backend can run, declared per op and variant (ggml's ``supports_op``).

A capability is ``op[variant]`` — e.g. ``linear[q8_0]``, ``rms_norm[f32]``,
``attention[paged]``. For ops that read a weight the variant is the weight format; for the
others it names the math variant. A backend declares a static set (read without touching a
device); a model family states, for a concrete model config and its weight formats, the set
it needs; :func:`missing_capabilities` is the difference. The capabilities the core knows
are derived from its op declarations (:data:`zllm.domain.ops.CORE_CAPABILITIES`); a
capability added there is absent from every backend until that backend declares it (and
registers a kernel for it).
"""

from __future__ import annotations

import attrs


@attrs.frozen(order=True)
class Capability:
    """One op variant a backend can run. ``str()`` gives ``op[variant]``."""

    op: str
    variant: str

    def __str__(self) -> str:
        return f"{self.op}[{self.variant}]"

    @classmethod
    def parse(cls, text: str) -> Capability:
        """Parse ``op[variant]``. Raises ValueError on other shapes."""
        op, sep, rest = text.partition("[")
        if not sep or not rest.endswith("]") or not op:
            raise ValueError(f"capability must look like 'op[variant]', got {text!r}")
        return cls(op, rest[:-1])


def missing_capabilities(needed: frozenset[Capability] | set[Capability], provided: frozenset[Capability]) -> list[str]:
    """Sorted ``op[variant]`` strings of ``needed`` that ``provided`` lacks."""
    return sorted(str(c) for c in needed - provided)
