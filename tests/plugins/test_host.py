"""The plugin host: entry-point discovery, ZLLM_PLUGINS, the API handshake, broken plugins."""

from __future__ import annotations

import warnings

import pytest

from tests.conftest import CONFIGS
from tests.plugins.conftest import LLAMA_F32_NEEDS
from zllm import Engine
from zllm.capabilities import Capability
from zllm.engine.engine import plugin_allowlist_from_env
from zllm.plugins.hookspecs import PLUGIN_API_VERSION
from zllm.plugins.host import PluginHost, PluginWarning
from zllm.spec.errors import PluginError

CORE_API = f"{PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1]}"


def test_installed_cpu_backend_and_llama_family_arrive_through_entry_points(installed_eps):
    by_name = {ep.name: ep for ep in installed_eps}
    assert by_name["cpu"].value == "zllm_backend_cpu.plugin"
    assert by_name["llama"].value == "zllm_model_llama.plugin"

    host = PluginHost()

    records = {r.name: r for r in host.records}
    assert records["cpu"].status == "loaded", records["cpu"].reason
    assert records["llama"].status == "loaded", records["llama"].reason
    assert (records["cpu"].distribution, records["cpu"].api) == ("zllm-backend-cpu", "1.3")
    assert (records["llama"].distribution, records["llama"].api) == ("zllm-model-llama", "1.3")
    assert records["cpu"].kinds == ["backend:cpu"] and records["llama"].kinds == [
        "family:llama", "family:mistral", "family:qwen2", "family:qwen3", "family:mixtral", "family:qwen2_moe",
        "family:qwen3_moe"]
    assert "cpu" in host.backends and "llama" in host.families


def test_core_has_no_builtin_backend_or_family_without_entry_points():
    # The defaults are plugins like any other: with no entry points there is nothing but
    # the core's own f32 references.
    host = PluginHost(entry_points=[])
    assert host.backends == {} and host.families == {} and host.records == []
    assert {e.backend for e in host.kernels.entries()} == {"reference"}


def test_record_reports_distribution_version_api_and_core_requirement(plugins):
    ep = plugins.backend("acme", dist="zllm-backend-acme", version="3.2.1")
    host = PluginHost(entry_points=[ep])
    (rec,) = host.records
    assert (rec.name, rec.distribution, rec.version, rec.status, rec.api) == (
        "acme", "zllm-backend-acme", "3.2.1", "loaded", "1.0"
    )
    assert set(rec.requires_core.split(",")) == {">=0.1", "<0.2"}
    assert rec.kinds == ["backend:acme"]


def test_allowlist_loads_only_named_plugins_and_lists_the_rest_as_filtered(plugins):
    keep = plugins.backend("keep")
    drop = plugins.backend("drop")

    host = PluginHost(allowlist=["keep"], entry_points=[keep, drop])

    status = {r.name: (r.status, r.reason) for r in host.records}
    assert status["keep"] == ("loaded", "")
    assert status["drop"][0] == "filtered" and "ZLLM_PLUGINS" in status["drop"][1]
    assert list(host.backends) == ["keep"]
    # a filtered plugin is never imported, so a broken one cannot hurt
    assert not host.pm.has_plugin("drop")


def test_zllm_plugins_env_value_becomes_the_allowlist(installed_eps):
    allow = plugin_allowlist_from_env({"ZLLM_PLUGINS": "llama, "})
    assert allow == ["llama"]
    assert plugin_allowlist_from_env({}) is None and plugin_allowlist_from_env({"ZLLM_PLUGINS": ""}) is None

    host = PluginHost(allowlist=allow, entry_points=installed_eps)

    status = {r.name: r.status for r in host.records}
    assert status["llama"] == "loaded"
    assert status["cpu"] == "filtered"
    assert "cpu" not in host.backends


def test_allowlist_name_matching_no_plugin_warns_instead_of_silently_loading_nothing(plugins):
    ep = plugins.backend("real")
    with pytest.warns(PluginWarning, match=r"ZLLM_PLUGINS names lama, which no installed plugin provides.*real"):
        host = PluginHost(allowlist=["lama"], entry_points=[ep])
    assert host.backends == {}


def test_plugin_raising_on_import_is_skipped_with_warning_and_others_keep_working(plugins):
    broken = plugins.dist(
        "broken", "raise RuntimeError('driver table is corrupt')\n", dist="zllm-backend-broken", version="0.3.0"
    )
    good = plugins.backend("good")

    with pytest.warns(PluginWarning) as caught:
        host = PluginHost(entry_points=[broken, good])

    (msg,) = [str(w.message) for w in caught]
    assert "'broken'" in msg and "zllm-backend-broken 0.3.0" in msg
    assert "RuntimeError: driver table is corrupt" in msg
    rec = next(r for r in host.records if r.name == "broken")
    assert rec.status == "error" and "driver table is corrupt" in rec.reason
    assert list(host.backends) == ["good"]
    assert host.kernels.has("linear", "good", "f32")
    # the broken plugin's reason reaches users who ask for it
    assert any("broken" in r and "driver table is corrupt" in r for r in host.not_loaded_reasons())


@pytest.mark.parametrize("api", ["2.0", "0.9"])
def test_foreign_api_major_is_skipped_with_warning_naming_dist_version_and_both_apis(plugins, api):
    ep = plugins.backend("future", dist="zllm-backend-future", version="9.1.0", api=api)

    with pytest.warns(PluginWarning) as caught:
        host = PluginHost(entry_points=[ep])

    (msg,) = [str(w.message) for w in caught]
    assert "zllm-backend-future 9.1.0" in msg
    assert f"targets plugin API {api}" in msg and f"speaks {CORE_API}" in msg
    (rec,) = host.records
    assert (rec.status, rec.api) == ("skipped", api)
    assert host.backends == {} and not host.kernels.has("linear", "future", "f32")


def test_newer_minor_of_the_same_major_is_skipped_because_core_lacks_its_additions(plugins):
    newer = f"{PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1] + 1}"
    ep = plugins.backend("newer", api=newer)
    with pytest.warns(PluginWarning, match=rf"targets plugin API {newer} but this zllm-core speaks {CORE_API}"):
        host = PluginHost(entry_points=[ep])
    assert host.records[0].status == "skipped"


def test_plugin_without_api_declaration_is_skipped(plugins):
    ep = plugins.dist("silent", "from zllm.plugin_api import hookimpl\n")
    with pytest.warns(PluginWarning, match=r"declares no valid ZLLM_PLUGIN_API \(got None\)"):
        host = PluginHost(entry_points=[ep])
    assert host.records[0].status == "skipped"


def test_duplicate_backend_names_raise_naming_both_plugins(plugins):
    first = plugins.backend("twin", ep_name="vendor-a", dist="zllm-backend-a")
    second = plugins.backend("twin", ep_name="vendor-b", dist="zllm-backend-b")

    with pytest.raises(PluginError, match=r"backend 'twin' is published by two plugins: vendor-a and vendor-b"):
        PluginHost(entry_points=[second, first])


def test_two_families_claiming_one_model_type_raise_naming_both(plugins):
    src = '''
        from zllm.plugin_api import FamilyInfo, hookimpl
        ZLLM_PLUGIN_API = "1.0"

        @hookimpl
        def zllm_model_families():
            return [FamilyInfo(name="{name}", model_types=("llama",), factory="x:Y")]
    '''
    a = plugins.dist("fam-a", src.replace("{name}", "llama_a"))
    b = plugins.dist("fam-b", src.replace("{name}", "llama_b"))
    with pytest.raises(PluginError, match=r"model_type 'llama' is claimed by families 'llama_a' and 'llama_b'"):
        PluginHost(entry_points=[a, b])


def test_discovery_order_does_not_depend_on_entry_point_order(plugins):
    eps = [plugins.backend("zeta"), plugins.backend("alpha")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward, backward = PluginHost(entry_points=eps), PluginHost(entry_points=eps[::-1])
    assert [r.name for r in forward.records] == [r.name for r in backward.records] == ["alpha", "zeta"]




def test_a_plugin_api_1_1_backend_declaring_the_retired_sample_op_loads_with_a_warning(plugins):
    # Before plugin API 1.2 a backend declared and registered `sample`; the runtime's sampler
    # took that job over, and such a backend must keep loading.
    ep = plugins.backend("legacy", caps=LLAMA_F32_NEEDS + ', "sample[f32]"', api="1.1")
    with pytest.warns(PluginWarning, match=r"backend 'legacy' declares sample\[f32\], which the core no longer "
                                           r"takes from backends \(sample: since plugin API 1.2 the runtime's sampler"):
        host = PluginHost(entry_points=[ep])
    assert host.records[0].status == "loaded"
    assert Capability("sample", "f32") not in host.backends["legacy"].capabilities
    assert Capability("linear", "f32") in host.backends["legacy"].capabilities
    assert host.kernels.registered("sample") == []  # its kernel is dropped, so conformance never runs it
    assert "legacy/f32" in host.kernels.registered("linear")


OLD_FAMILY = """
    from zllm.plugin_api import Capability, FamilyInfo, hookimpl
    from zllm_model_llama.family import LlamaFamily

    ZLLM_PLUGIN_API = "1.1"

    class OldLlama(LlamaFamily):
        # A family written for plugin API 1.1 listed the sampler among its needs.
        def required_capabilities(self, spec, weight_formats):
            return super().required_capabilities(spec, weight_formats) | {Capability("sample", "f32")}

    @hookimpl
    def zllm_model_families():
        return [FamilyInfo(name="oldllama", model_types=("llama",), factory=__name__ + ":OldLlama")]
"""


def test_a_family_still_needing_the_retired_sample_op_loads_and_generates(plugins, installed_eps):
    cpu = [ep for ep in installed_eps if ep.name == "cpu"]
    host = PluginHost(entry_points=[*cpu, plugins.dist("oldllama", OLD_FAMILY)])
    engine = Engine.from_config(CONFIGS / "stories260k-hf.yaml", host=host)
    assert "sample" not in {c.op for c in engine.loaded.ops.choices}
    request = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.0}
    assert engine.generate(request)["token_ids"] == Engine.from_config(CONFIGS / "stories260k-hf.yaml").generate(
        request)["token_ids"]
