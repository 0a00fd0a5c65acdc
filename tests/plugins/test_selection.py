"""Backend selection: explicit choices raise with reasons, ``auto`` picks by priority and says why."""

from __future__ import annotations

import logging

import pytest

from zllm.capabilities import Capability
from zllm.plugins.host import PluginHost
from zllm.plugins.selection import select_backend
from zllm.spec.errors import BackendUnavailable, CapabilityError, PluginError

F32 = '"linear[f32]", "rms_norm[f32]"'
NEEDS_F32 = frozenset({Capability("linear", "f32"), Capability("rms_norm", "f32")})


def test_explicit_unknown_backend_lists_installed_backends_and_unloaded_plugins(plugins):
    eps = [plugins.backend("alpha"), plugins.backend("beta"),
           plugins.dist("broken", "raise ImportError('no libfoo')\n")]
    with pytest.warns(UserWarning):
        host = PluginHost(entry_points=eps)
    with pytest.raises(PluginError) as info:
        select_backend(host, "rocm", NEEDS_F32, "llama")
    msg = str(info.value)
    assert "backend 'rocm' is not provided by any loaded plugin (loaded backends: alpha, beta)" in msg
    assert "broken" in msg and "no libfoo" in msg


def test_explicit_unknown_backend_with_the_real_plugins_lists_cpu():
    host = PluginHost()
    with pytest.raises(PluginError,
                       match=r"backend 'tpu' is not provided by any loaded plugin \(loaded backends: [^)]*\bcpu\b"):
        select_backend(host, "tpu", NEEDS_F32, "llama")


def test_explicit_backend_missing_a_capability_raises_naming_capability_backend_and_family(plugins):
    host = PluginHost(entry_points=[plugins.backend("acme", caps=F32)])
    needed = NEEDS_F32 | {Capability("linear", "q4_0"), Capability("embedding", "q4_0")}
    with pytest.raises(CapabilityError) as info:
        select_backend(host, "acme", needed, "llama")
    err = info.value
    assert (err.missing, err.backend, err.family) == (["embedding[q4_0]", "linear[q4_0]"], "acme", "llama")
    assert str(err) == "backend 'acme' lacks capabilities embedding[q4_0], linear[q4_0] needed by model family 'llama'"


def test_capability_is_checked_before_the_backend_class_is_imported(plugins):
    # a device check may be slow or crash; a model the backend cannot run never gets there
    src = plugins.backend("acme", caps=F32, unavailable="never asked")
    host = PluginHost(entry_points=[src])
    with pytest.raises(CapabilityError):
        select_backend(host, "acme", NEEDS_F32 | {Capability("linear", "q8_0")}, "llama")


def test_explicit_unavailable_backend_raises_with_its_own_reason(plugins):
    host = PluginHost(entry_points=[plugins.backend("gpu", caps=F32, unavailable="torch.cuda.is_available() is False")])
    with pytest.raises(BackendUnavailable, match=r"^backend gpu: torch.cuda.is_available\(\) is False$"):
        select_backend(host, "gpu", NEEDS_F32, "llama")


def test_explicit_valid_backend_is_chosen_with_reason(plugins):
    host = PluginHost(entry_points=[plugins.backend("acme", caps=F32)])
    choice = select_backend(host, "acme", NEEDS_F32, "llama")
    assert choice.info.name == "acme" and choice.cls.__name__ == "Backend"
    assert choice.reason == "backend 'acme' named in config"


def test_auto_picks_highest_priority_viable_backend_and_reports_skipped_reasons(plugins, caplog):
    host = PluginHost(entry_points=[
        plugins.backend("fast", caps=F32, priority=30, unavailable="no device found"),
        plugins.backend("partial", caps='"linear[f32]"', priority=20),
        plugins.backend("steady", caps=F32, priority=10),
        plugins.backend("slow", caps=F32, priority=0),
    ])
    with caplog.at_level(logging.INFO, logger="zllm.plugins.selection"):
        choice = select_backend(host, "auto", NEEDS_F32, "llama")

    assert choice.info.name == "steady"
    assert "highest priority (10)" in choice.reason
    assert "fast: no device found" in choice.reason
    assert "partial: lacks rms_norm[f32]" in choice.reason
    assert "selected backend steady" in caplog.text


def test_auto_with_nothing_viable_raises_carrying_every_candidates_reason(plugins):
    host = PluginHost(entry_points=[
        plugins.backend("fast", caps=F32, priority=30, unavailable="no device found"),
        plugins.backend("partial", caps='"linear[f32]"', priority=20),
    ])
    with pytest.raises(PluginError, match=r"no backend can run model family 'llama': "
                                          r"fast: no device found; partial: lacks rms_norm\[f32\]"):
        select_backend(host, "auto", NEEDS_F32, "llama")


def test_auto_with_no_backend_installed_says_so():
    with pytest.raises(PluginError, match="no backend plugin installed"):
        select_backend(PluginHost(entry_points=[]), "auto", NEEDS_F32, "llama")


def test_backend_class_failing_to_import_is_a_reason_not_a_crash(plugins):
    src = '''
        from zllm.plugin_api import BackendInfo, Capability, hookimpl
        ZLLM_PLUGIN_API = "1.0"

        @hookimpl
        def zllm_backends():
            return [BackendInfo(name="ghost", factory="zllm_no_such_module_xyz:Backend",
                                capabilities=frozenset({Capability("linear", "f32"), Capability("rms_norm", "f32")}))]
    '''
    host = PluginHost(entry_points=[plugins.dist("ghost", src)])
    with pytest.raises(PluginError, match=r"ghost: backend class zllm_no_such_module_xyz:Backend "
                                          r"failed to import: ModuleNotFoundError"):
        select_backend(host, "auto", NEEDS_F32, "llama")
