"""Backend selection with reasons (vLLM's per-backend reasons, ggml's priority score).

An explicit choice that cannot run raises with its reason; ``auto`` picks the highest
priority backend that is available and declares every needed capability, and logs what it
chose and why; when nothing qualifies the error carries every candidate's reasons.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from zllm.capabilities import Capability, missing_capabilities
from zllm.capabilities.backend import BackendInfo
from zllm.plugins.host import PluginHost
from zllm.spec.errors import BackendUnavailable, CapabilityError, PluginError

log = logging.getLogger(__name__)


@attrs.frozen
class BackendChoice:
    """The selected backend, its class, and why it was chosen."""

    info: BackendInfo
    cls: type[Any]
    reason: str


def unavailable_reason(info: BackendInfo) -> tuple[type[Any] | None, str | None]:
    """Import the backend class and ask it whether it can run here; a class that fails to
    import, or whose ``unavailable_reason()`` raises, is unavailable with that error as reason."""
    try:
        cls = info.load_class()
    except Exception as exc:  # report, never swallow: the user asked about this backend
        return None, f"backend class {info.factory} failed to import: {type(exc).__name__}: {exc}"
    try:
        return cls, cls.unavailable_reason()
    except Exception as exc:  # a probe that crashes must not take `zllm plugins` down with it
        return cls, f"{info.factory}.unavailable_reason() raised {type(exc).__name__}: {exc}"


def select_backend(host: PluginHost, name: str, needed: frozenset[Capability], family: str) -> BackendChoice:
    """Choose the backend for a model family's needed capabilities.

    Args:
        name: ``backend.name`` from the config: a backend name or ``auto``.
        needed: capabilities the family needs for this checkpoint.
        family: family name, for error messages.

    Raises:
        PluginError: the named backend is not installed (lists installed ones and plugins
            that were not loaded, with reasons) or nothing qualifies under ``auto``.
        BackendUnavailable: the named backend's device is absent (its own reason).
        CapabilityError: the named backend lacks capabilities the family needs.
    """
    if name != "auto":
        info = host.backends.get(name)
        if info is None:
            loaded = ", ".join(sorted(host.backends)) or "none"
            extra = host.not_loaded_reasons()
            raise PluginError(
                f"backend {name!r} is not provided by any loaded plugin (loaded backends: {loaded})"
                + (f"; plugins not loaded: {'; '.join(extra)}" if extra else "")
            )
        missing = missing_capabilities(needed, info.capabilities)
        if missing:
            raise CapabilityError(missing, name, family)
        cls, why_not = unavailable_reason(info)
        if why_not is not None:
            raise BackendUnavailable(f"backend {name}: {why_not}")
        assert cls is not None  # only a class that failed to import has no class, and it has a reason
        return BackendChoice(info, cls, f"backend {name!r} named in config")
    reasons: list[str] = []
    for info in sorted(host.backends.values(), key=lambda b: (-b.priority, b.name)):
        missing = missing_capabilities(needed, info.capabilities)
        if missing:
            reasons.append(f"{info.name}: lacks {', '.join(missing)}")
            continue
        cls, why_not = unavailable_reason(info)
        if why_not is not None:
            reasons.append(f"{info.name}: {why_not}")
            continue
        assert cls is not None  # only a class that failed to import has no class, and it has a reason
        reason = f"auto: highest priority ({info.priority}) backend that is available and declares every capability"
        if reasons:
            reason += f"; skipped {'; '.join(reasons)}"
        log.info("selected backend %s: %s", info.name, reason)
        return BackendChoice(info, cls, reason)
    raise PluginError(
        f"no backend can run model family {family!r}: " + ("; ".join(reasons) or "no backend plugin installed")
    )
