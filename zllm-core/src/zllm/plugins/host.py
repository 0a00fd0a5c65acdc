"""The plugin host: discovers entry points in the group ``zllm``, checks each plugin's
API handshake, and collects backends, model families and kernels.

Nothing here is global: each :class:`PluginHost` owns its pluggy manager and kernel
registry, so results never depend on import order or on an earlier host.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from importlib import metadata

import attrs
import pluggy

from zllm.capabilities.backend import BackendInfo
from zllm.capabilities.ops import OpTable
from zllm.domain.family import FamilyInfo
from zllm.domain.ops import CORE_OPS, RETIRED_OPS, register_references, without_retired
from zllm.kernels.registry import KernelRegistry
from zllm.plugins import hookspecs
from zllm.plugins.hookspecs import PLUGIN_API_VERSION
from zllm.spec.errors import PluginError
from zllm.weights.gguf_maps import GGUFArchMap

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "zllm"


class PluginWarning(UserWarning):
    """A plugin was skipped (API mismatch, import error). The message names it and why."""


@attrs.define
class PluginRecord:
    """One entry point as the host saw it.

    Attributes:
        name: entry-point name (the name ``ZLLM_PLUGINS`` filters on).
        distribution, version: the installed distribution that declared it.
        status: ``loaded`` | ``skipped`` | ``filtered`` | ``error``.
        reason: why it is not loaded (empty when loaded).
        api: the plugin-API version it targets, as declared (``"1.0"``), or ``""``.
        requires_core: its ``zllm-core`` requirement specifier, e.g. ``>=0.1,<0.2``.
        kinds: what it published: ``backend:cpu``, ``family:llama`` ...
    """

    name: str
    distribution: str
    version: str
    status: str = "loaded"
    reason: str = ""
    api: str = ""
    requires_core: str = ""
    kinds: list[str] = attrs.Factory(list)

    @property
    def kind(self) -> str:
        return ", ".join(self.kinds) if self.kinds else "-"


def parse_api_version(text: object) -> tuple[int, int] | None:
    """``"1.0"`` -> ``(1, 0)``; anything else -> None."""
    if not isinstance(text, str):
        return None
    major, _, minor = text.partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        return None
    return int(major), int(minor or "0")


def _core_requirement(dist: metadata.Distribution | None) -> str:
    if dist is None:
        return ""
    for req in dist.requires or []:
        name = req.split(";")[0]
        for sep in ("<", ">", "=", "!", "~", " ", "["):
            name = name.split(sep)[0]
        if name.strip().lower().replace("_", "-") == "zllm-core":
            return req[len(name):].split(";")[0].strip()
    return ""


class PluginHost:
    """Loads plugins and answers what backends, families and kernels exist.

    Args:
        allowlist: entry-point names to load (the ``ZLLM_PLUGINS`` setting, read by the
            caller at the edge); ``None`` loads all.
        entry_points: override of the discovered entry points (tests pass their own).
        ops: the op declarations this host knows (default: the core's); their references are
            registered under ``reference``, and binding and conformance read them from
            :attr:`ops`.
    """

    def __init__(self, allowlist: Iterable[str] | None = None,
                 entry_points: Iterable[metadata.EntryPoint] | None = None, ops: OpTable = CORE_OPS):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.allowlist = None if allowlist is None else {a.strip() for a in allowlist if a.strip()}
        self.records: list[PluginRecord] = []
        self.ops = ops
        self.kernels = KernelRegistry()
        register_references(self.kernels, ops)
        eps = list(entry_points) if entry_points is not None else list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        for ep in sorted(eps, key=lambda e: e.name):
            self._load(ep)
        unmatched = sorted((self.allowlist or set()) - {ep.name for ep in eps})
        if unmatched:
            # A misspelt ZLLM_PLUGINS entry would otherwise filter everything out and look
            # like "no plugin installed".
            installed = ", ".join(sorted(ep.name for ep in eps)) or "none"
            warnings.warn(
                f"ZLLM_PLUGINS names {', '.join(unmatched)}, which no installed plugin provides "
                f"(installed entry points: {installed})",
                PluginWarning,
                stacklevel=2,
            )
        self.backends: dict[str, BackendInfo] = {}
        self.families: dict[str, FamilyInfo] = {}
        #: GGUF architecture -> map, from every family's ``gguf_architectures``.
        self.gguf_maps: dict[str, GGUFArchMap] = {}
        self._gguf_owner: dict[str, str] = {}
        self._collect()
        self.pm.hook.zllm_register_kernels(registry=self.kernels)
        for op in RETIRED_OPS:
            self.kernels.drop(op)

    def _load(self, ep: metadata.EntryPoint) -> None:
        dist = ep.dist
        rec = PluginRecord(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist else "?",
            version=dist.version if dist else "?",
            requires_core=_core_requirement(dist),
        )
        self.records.append(rec)
        if self.allowlist is not None and ep.name not in self.allowlist:
            rec.status, rec.reason = "filtered", f"not in ZLLM_PLUGINS ({','.join(sorted(self.allowlist))})"
            return
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            rec.status, rec.reason = "error", f"import failed: {type(exc).__name__}: {exc}"
            warnings.warn(f"zllm plugin {ep.name!r} ({rec.distribution} {rec.version}) skipped: {rec.reason}",
                          PluginWarning, stacklevel=2)
            return
        declared = getattr(module, "ZLLM_PLUGIN_API", None)
        rec.api = str(declared) if declared is not None else ""
        api = parse_api_version(declared)
        speaks = f"{PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1]}"
        if api is None:
            rec.status, rec.reason = (
                "skipped", f"declares no valid ZLLM_PLUGIN_API (got {declared!r}); core speaks {speaks}"
            )
        elif api[0] != PLUGIN_API_VERSION[0] or api[1] > PLUGIN_API_VERSION[1]:
            rec.status, rec.reason = "skipped", f"targets plugin API {declared} but this zllm-core speaks {speaks}"
        if rec.status == "skipped":
            warnings.warn(f"zllm plugin {ep.name!r} ({rec.distribution} {rec.version}) skipped: {rec.reason}",
                          PluginWarning, stacklevel=2)
            return
        self.pm.register(module, name=ep.name)

    def _collect(self) -> None:
        by_name = {r.name: r for r in self.records}
        for impl in self.pm.hook.zllm_backends.get_hookimpls():
            backends: list[BackendInfo] = impl.function() or []  # type: ignore[assignment]  # pluggy types results as object
            for info in backends:
                retired = sorted(map(str, info.capabilities - without_retired(info.capabilities)))
                if retired:
                    why = "; ".join(f"{op}: {RETIRED_OPS[op]}" for op in sorted({c.split("[")[0] for c in retired}))
                    warnings.warn(f"zllm plugin {impl.plugin_name!r}: backend {info.name!r} declares "
                                  f"{', '.join(retired)}, which the core no longer takes from backends ({why}); "
                                  "ignored", PluginWarning, stacklevel=2)
                    info = attrs.evolve(info, capabilities=without_retired(info.capabilities))
                if info.name in self.backends:
                    raise PluginError(f"backend {info.name!r} is published by two plugins: "
                                      f"{self._owner(info.name, 'backend')} and {impl.plugin_name}")
                self.backends[info.name] = info
                by_name[impl.plugin_name].kinds.append(f"backend:{info.name}")
        claimed: dict[str, str] = {}
        for impl in self.pm.hook.zllm_model_families.get_hookimpls():
            families: list[FamilyInfo] = impl.function() or []  # type: ignore[assignment]  # pluggy types results as object
            for fam in families:
                for mt in fam.model_types:
                    if mt in claimed:
                        raise PluginError(f"model_type {mt!r} is claimed by families {claimed[mt]!r} and {fam.name!r}")
                    claimed[mt] = fam.name
                self.families[fam.name] = fam
                by_name[impl.plugin_name].kinds.append(f"family:{fam.name}")
                self._collect_gguf_maps(fam)

    def _collect_gguf_maps(self, info: FamilyInfo) -> None:
        for arch, arch_map in info.gguf_architectures.items():
            if arch in self.gguf_maps:
                raise PluginError(f"GGUF architecture {arch!r} is mapped by families {self._gguf_owner[arch]!r} "
                                  f"and {info.name!r}")
            if arch_map.model_type not in info.model_types:
                raise PluginError(f"family {info.name!r} maps GGUF architecture {arch!r} to model_type "
                                  f"{arch_map.model_type!r}, which it does not handle (its model types: "
                                  f"{', '.join(info.model_types)})")
            self.gguf_maps[arch] = arch_map
            self._gguf_owner[arch] = info.name

    def _owner(self, name: str, kind: str) -> str:
        return next((r.name for r in self.records if f"{kind}:{name}" in r.kinds), "?")

    def family_for(self, model_type: str) -> FamilyInfo | None:
        """The family that handles an HF ``model_type``, or None."""
        return next((f for f in self.families.values() if model_type in f.model_types), None)

    def known_model_types(self) -> list[str]:
        return sorted(mt for f in self.families.values() for mt in f.model_types)

    def not_loaded_reasons(self) -> list[str]:
        """``name (distribution): reason`` for every plugin that is not loaded."""
        return [f"{r.name} ({r.distribution}): {r.status}: {r.reason}" for r in self.records if r.status != "loaded"]
