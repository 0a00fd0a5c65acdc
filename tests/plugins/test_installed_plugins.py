"""Every installed plugin imports, speaks the core's API, and provides what it declares."""

from __future__ import annotations

import warnings
from importlib import metadata

import pytest
from packaging.specifiers import SpecifierSet

from zllm.capabilities import Capability
from zllm.domain.ops import CORE_CAPABILITIES
from zllm.plugins.host import PluginHost
from zllm.weights.formats import ALL_FORMATS

INSTALLED = sorted(ep.name for ep in metadata.entry_points(group="zllm"))


@pytest.fixture(scope="module")
def host() -> PluginHost:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any skipped plugin fails here, with its reason
        return PluginHost()


def test_the_default_plugins_are_installed():
    # the parametrized tests below would pass vacuously on an empty environment
    assert {"cpu", "llama"} <= set(INSTALLED)


def test_host_registered_only_hooks_the_core_specifies(host):
    host.pm.check_pending()  # raises naming any hookimpl without a hookspec (a typo'd hook name)


@pytest.mark.parametrize("name", INSTALLED)
def test_installed_plugin_imports_and_is_loaded(host, name):
    (ep,) = [ep for ep in metadata.entry_points(group="zllm") if ep.name == name]
    ep.load()
    rec = next(r for r in host.records if r.name == name)
    assert rec.status == "loaded", rec.reason
    assert rec.kinds, f"plugin {name} publishes no backend and no family"


@pytest.mark.parametrize("name", INSTALLED)
def test_installed_plugin_accepts_this_zllm_core_version(host, name):
    rec = next(r for r in host.records if r.name == name)
    core = metadata.version("zllm-core")
    assert rec.requires_core, f"{rec.distribution} does not pin a zllm-core range"
    assert core in SpecifierSet(rec.requires_core), (
        f"{rec.distribution} requires zllm-core{rec.requires_core}, installed {core}")


def _published() -> PluginHost:
    # parametrization happens at collection; a broken plugin is reported by the tests above
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PluginHost()


def _backends() -> list[str]:
    return sorted(_published().backends)


def _families() -> list[str]:
    return sorted(_published().families)


@pytest.mark.parametrize("backend", _backends())
def test_backend_declared_capabilities_equal_its_registered_kernels(host, backend):
    info = host.backends[backend]
    registered = {Capability(e.op, f) for e in host.kernels.entries() if e.backend == backend for f in e.formats}
    assert sorted(map(str, info.capabilities - registered)) == [], "declared but no kernel registered"
    assert sorted(map(str, registered - info.capabilities)) == [], "kernel registered but not declared"
    assert sorted(map(str, info.capabilities - CORE_CAPABILITIES)) == [], "declared capabilities unknown to the core"


@pytest.mark.parametrize("backend", _backends())
def test_backend_class_and_every_kernel_import_without_a_device(host, backend):
    cls = host.backends[backend].load_class()
    assert isinstance(cls.unavailable_reason(), (str, type(None)))
    for entry in (e for e in host.kernels.entries() if e.backend == backend):
        assert callable(entry.resolve()), entry.name


@pytest.mark.parametrize("family", _families())
def test_family_needs_only_core_capabilities_for_every_weight_format(host, family):
    fam = host.families[family].load()
    for fmt in ALL_FORMATS:
        needed = fam.format_capabilities(fmt)
        assert Capability("linear", fmt) in needed
        assert sorted(map(str, needed - CORE_CAPABILITIES)) == [], fmt
