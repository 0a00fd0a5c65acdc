"""Fixtures that install tiny plugin distributions on disk, without pip.

A fake plugin here is real in every way the host can see: a module file on ``sys.path`` and
a ``*.dist-info`` folder with ``METADATA`` and ``entry_points.txt``, read back through
``importlib.metadata``. The host receives the entry points through its ``entry_points=``
argument, so the test's plugins and the real installed ones never mix by accident.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class PluginFactory:
    """Writes plugin distributions under ``root``; each gets its own site folder."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: list[str] = []

    def module(self, source: str, stem: str = "mod") -> str:
        """Write a uniquely named module (so no test sees another's ``sys.modules`` entry); return its name."""
        name = f"zllm_test_{stem}_{uuid.uuid4().hex[:8]}"
        site = self.root / "modules"
        site.mkdir(exist_ok=True)
        (site / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        self.monkeypatch.syspath_prepend(str(site))
        self.modules.append(name)
        return name

    def dist(
        self,
        ep_name: str,
        source: str,
        *,
        dist: str | None = None,
        version: str = "0.0.1",
        requires_core: str = ">=0.1,<0.2",
    ) -> metadata.EntryPoint:
        """A distribution ``dist`` whose entry point ``ep_name`` (group ``zllm``) is a module with ``source``."""
        dist = dist or f"zllm-test-{ep_name}"
        module = self.module(source, stem=ep_name.replace("-", "_"))
        site = self.root / f"site-{dist}"
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        requires = f"Requires-Dist: zllm-core{requires_core}\n" if requires_core else ""
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n{requires}",
                                       encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[zllm]\n{ep_name} = {module}\n", encoding="utf-8")
        (ep,) = [ep for d in metadata.distributions(path=[str(site)]) for ep in d.entry_points if ep.group == "zllm"]
        return ep

    def backend(self, name: str, *, ep_name: str | None = None, dist: str | None = None, version: str = "0.0.1",
                **source_options) -> metadata.EntryPoint:
        """A distribution publishing backend ``name`` under entry point ``ep_name`` (default: the
        same); ``source_options`` go to :func:`backend_source`."""
        return self.dist(ep_name or name, backend_source(name, **source_options), dist=dist, version=version)


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    factory = PluginFactory(tmp_path, monkeypatch)
    yield factory
    for name in factory.modules:
        sys.modules.pop(name, None)


@pytest.fixture
def installed_eps() -> list[metadata.EntryPoint]:
    """The real entry points of the test environment (cpu backend, llama family, ...)."""
    return list(metadata.entry_points(group="zllm"))


def backend_source(name: str, *, caps: str = '"linear[f32]"', priority: int = 0, unavailable: str | None = None,
                   api: str = "1.0", register: bool = True) -> str:
    """Source of a backend plugin module: publishes ``name`` with ``caps`` (comma-separated
    ``"op[variant]"`` literals), a backend class that reports ``unavailable``, and one
    kernel per capability (``torch.add`` stands in: these tests never call kernels)."""
    return f'''
        from zllm.plugin_api import BackendInfo, Capability, hookimpl

        ZLLM_PLUGIN_API = {api!r}
        CAPS = frozenset(Capability.parse(c) for c in ({caps},))

        class Backend:
            name = {name!r}

            @classmethod
            def unavailable_reason(cls):
                return {unavailable!r}

        @hookimpl
        def zllm_backends():
            return [BackendInfo(name={name!r}, factory=__name__ + ":Backend", capabilities=CAPS, priority={priority})]

        @hookimpl
        def zllm_register_kernels(registry):
            if {register!r}:
                for c in sorted(CAPS):
                    registry.register(c.op, {name!r}, (c.variant,), "torch:add", registered_by=__name__)
    '''


LLAMA_F32_NEEDS = (
    '"embedding[f32]", "linear[f32]", "rms_norm[f32]", "rope[neox]", "attention[paged]", "silu_mul[f32]"'
)
