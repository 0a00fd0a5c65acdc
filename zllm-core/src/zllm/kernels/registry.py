"""The kernel registry: (op, backend, format) -> implementation, with the reason it was chosen.

Implementations are registered as lazy ``"module:attr"`` references (or callables) so that
registering costs no import of a device runtime. Duplicate registration raises unless
``replace=True``; a replacement is logged naming who replaced whom. Lookup never falls back
to another backend: a miss raises :class:`~zllm.spec.errors.KernelNotFound` listing what is
registered for the op. The f32 references live under the pseudo-backend ``reference`` and
are chosen only when the caller forces them (config ``backend.force_reference``).

Batch invariance: a kernel registered with ``batch_invariant=True`` declares that each output
row (token) is bit-identical whatever else is in the call — other sequences' rows, how many
rows there are, where the row sits, and for attention how a sequence's queries were split
into chunks. ``lookup(..., batch_invariant=True)`` (config ``runtime.batch_invariant``)
considers only such kernels and raises :class:`~zllm.spec.errors.KernelNotFound` naming the
op and backend when there is none; it never falls back to a batch-dependent kernel.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import attrs

from zllm.spec.errors import KernelNotFound

log = logging.getLogger(__name__)

REFERENCE_BACKEND = "reference"


@attrs.define
class KernelEntry:
    """One registered kernel. ``impl`` is a callable or a ``"module:attr"`` string."""

    op: str
    backend: str
    formats: tuple[str, ...]
    impl: Callable | str
    priority: int = 0
    registered_by: str = "unknown"
    batch_invariant: bool = False
    note: str | None = None
    # The imported callable, cached apart from ``impl`` so that ``name`` (shown by
    # ``--explain`` and in replacement logs) stays the reference the plugin registered.
    _resolved: Callable | None = attrs.field(default=None, init=False, repr=False)

    def resolve(self) -> Callable:
        """Import (once) and return the implementation."""
        if self._resolved is None:
            if isinstance(self.impl, str):
                module, _, attr = self.impl.partition(":")
                self._resolved = getattr(importlib.import_module(module), attr)
            else:
                self._resolved = self.impl
        return self._resolved

    @property
    def name(self) -> str:
        impl = self.impl if isinstance(self.impl, str) else f"{self.impl.__module__}:{self.impl.__qualname__}"
        return impl


@attrs.frozen
class KernelChoice:
    """The result of a lookup: the callable, its entry and a human-readable reason."""

    fn: Callable
    entry: KernelEntry
    reason: str


class KernelRegistry:
    """Registry of kernels keyed by ``(op, backend, format)``. Not global: the plugin host owns one."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], list[KernelEntry]] = {}

    def register(
        self,
        op: str,
        backend: str,
        formats: tuple[str, ...] | list[str],
        impl: Callable | str,
        *,
        priority: int = 0,
        replace: bool = False,
        registered_by: str = "unknown",
        batch_invariant: bool = False,
        note: str | None = None,
    ) -> None:
        """Register ``impl`` for ``op`` on ``backend`` for each format in ``formats``.

        Several kernels may share a key at different priorities (the highest wins).
        ``batch_invariant`` declares the kernel batch-invariant (module docstring); such a
        kernel is the only kind chosen in batch-invariant mode, so a backend whose fast
        kernel is batch-dependent registers its invariant one at a lower priority.
        ``note`` is appended to the reason whenever this kernel is chosen: what the user
        should know about the choice, e.g. why a faster kernel is not registered.

        Raises:
            ValueError: a kernel with the same key and priority exists and ``replace`` is false.
        """
        entry = KernelEntry(op, backend, tuple(formats), impl, priority, registered_by, batch_invariant, note)
        for fmt in entry.formats:
            slot = self._entries.setdefault((op, backend, fmt), [])
            clash = [e for e in slot if e.priority == priority]
            if clash and not replace:
                raise ValueError(
                    f"kernel {op!r} for backend {backend!r} format {fmt!r} priority {priority} is already "
                    f"registered by {clash[0].registered_by} ({clash[0].name}); pass replace=True to replace it"
                )
            for old in clash:
                log.warning(
                    "kernel %s/%s/%s: %s (%s) replaces %s (%s)",
                    op, backend, fmt, registered_by, entry.name, old.registered_by, old.name,
                )
                slot.remove(old)
            slot.append(entry)
            slot.sort(key=lambda e: -e.priority)

    def drop(self, op: str) -> list[KernelEntry]:
        """Remove every kernel registered for ``op``; return them (the plugin host drops the
        kernels of a retired op this way)."""
        dropped = {id(e): e for key in [k for k in self._entries if k[0] == op] for e in self._entries.pop(key)}
        return list(dropped.values())

    def registered(self, op: str, *, batch_invariant: bool = False) -> list[str]:
        """``backend/format`` strings registered for ``op`` (only batch-invariant kernels
        when ``batch_invariant``), sorted."""
        return sorted(f"{b}/{f}" for (o, b, f), slot in self._entries.items()
                      if o == op and slot and (not batch_invariant or any(e.batch_invariant for e in slot)))

    def has(self, op: str, backend: str, fmt: str) -> bool:
        return bool(self._entries.get((op, backend, fmt)))

    def entries(self) -> list[KernelEntry]:
        """Every distinct entry, in a stable order."""
        seen: dict[int, KernelEntry] = {}
        for key in sorted(self._entries):
            for e in self._entries[key]:
                seen.setdefault(id(e), e)
        return list(seen.values())

    def lookup(self, op: str, backend: str, fmt: str, *, force_reference: bool = False,
               batch_invariant: bool = False) -> KernelChoice:
        """The kernel for ``(op, backend, fmt)`` and why it was chosen.

        With ``force_reference`` the f32 reference registered under ``reference`` is
        returned instead (the config asked for it by name). With ``batch_invariant`` only
        kernels registered as batch-invariant are candidates.

        Raises:
            KernelNotFound: nothing is registered for the key, or (``batch_invariant``)
                nothing batch-invariant; the message names op, backend and format.
        """
        key_backend = REFERENCE_BACKEND if force_reference else backend
        slot = self._entries.get((op, key_backend, fmt))
        if not slot:
            raise KernelNotFound(op, key_backend, fmt, self.registered(op))
        if batch_invariant:
            slot = [e for e in slot if e.batch_invariant]
            if not slot:
                raise KernelNotFound(op, key_backend, fmt, self.registered(op, batch_invariant=True),
                                     batch_invariant=True)
            entry = slot[0]
            return KernelChoice(entry.resolve(), entry,
                                _with_note(f"batch-invariant kernel for {op}/{key_backend}/{fmt} "
                                           f"(runtime.batch_invariant; by {entry.registered_by})", entry))
        entry = slot[0]
        if force_reference:
            reason = f"f32 reference forced by config backend.force_reference (instead of backend {backend!r})"
        elif len(slot) == 1:
            reason = f"only kernel registered for {op}/{backend}/{fmt} (by {entry.registered_by})"
        else:
            others = ", ".join(f"{e.name} (priority {e.priority})" for e in slot[1:])
            reason = f"highest priority {entry.priority} for {op}/{backend}/{fmt}; also registered: {others}"
        return KernelChoice(entry.resolve(), entry, _with_note(reason, entry))


def _with_note(reason: str, entry: KernelEntry) -> str:
    return reason if entry.note is None else f"{reason}; {entry.note}"
