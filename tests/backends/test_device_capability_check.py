"""The loader's per-device capability check (``Backend.unsupported_capabilities``), end to end.

The backend here is the Metal backend's composition — every zllm-kernels-torch kernel on a
``TorchDeviceBackend`` — put on the CPU device, installed as a plugin of its own. It
withdraws capabilities the way a GPU backend does for its device (bf16 below sm_80, say).
A model that needs one fails before any weight is read, naming capability, backend, family
and reason; a model that needs none of them loads and generates the CPU backend's tokens.
"""

from __future__ import annotations

import textwrap
import uuid
from importlib import metadata

import pytest

import zllm
from tests.conftest import MODEL_DIR
from zllm.plugins.host import PluginHost
from zllm.spec.errors import CapabilityError

PLUGIN = '''
from zllm.plugin_api import BackendInfo, hookimpl
from zllm_kernels_torch.device import TorchDeviceBackend
from zllm_kernels_torch.table import TORCH_KERNELS, capabilities, register_rows

ZLLM_PLUGIN_API = "1.0"


class HostBackend(TorchDeviceBackend):
    name = "torch-host"
    device_type = "cpu"

    @classmethod
    def device_count(cls):
        return 1

    @classmethod
    def unavailable_reason(cls):
        return None

    def unsupported_capabilities(self):
        return {unsupported!r}


@hookimpl
def zllm_backends():
    return [BackendInfo("torch-host", __name__ + ":HostBackend", capabilities(TORCH_KERNELS))]


@hookimpl
def zllm_register_kernels(registry):
    register_rows(registry, "torch-host", TORCH_KERNELS, registered_by=__name__)
'''


@pytest.fixture
def host_with(tmp_path, monkeypatch):
    """A plugin host with the llama family and a torch-host backend that withdraws ``unsupported``."""

    def make(unsupported: dict[str, str]) -> PluginHost:
        name = f"zllm_test_torch_host_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN).format(unsupported=unsupported), encoding="utf-8")
        monkeypatch.syspath_prepend(str(tmp_path))
        llama = [ep for ep in metadata.entry_points(group="zllm") if ep.name == "llama"]
        return PluginHost(entry_points=[*llama, metadata.EntryPoint("torch-host", name, "zllm")])

    return make


def config(backend: str) -> dict:
    return {"schema_version": 1, "model": {"path": str(MODEL_DIR / "hf")}, "backend": {"name": backend},
            "runtime": {"kv_cache": {"num_blocks": 64}}}


def test_a_needed_capability_the_device_withdraws_fails_before_any_weight_is_read(host_with):
    host = host_with({"linear[f32]": "this device has no f32 GEMM", "linear[bf16]": "no bf16 here"})
    started = []
    with pytest.raises(CapabilityError) as info:
        zllm.Engine.from_config(config("torch-host"), host=host, on_start=started.append)
    assert str(info.value) == ("backend 'torch-host' lacks capability linear[f32] needed by model family 'llama' "
                               "on this device: this device has no f32 GEMM")
    assert info.value.missing == ["linear[f32]"] and started == []


def test_withdrawn_capabilities_the_model_does_not_need_leave_it_running_with_the_cpu_tokens(host_with):
    host = host_with({"embedding[bf16]": "no bf16 here", "linear[bf16]": "no bf16 here"})
    request = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.0}
    torch_host = zllm.Engine.from_config(config("torch-host"), host=host).generate(request)
    cpu = zllm.Engine.from_config(config("cpu")).generate(request)
    assert len(torch_host["token_ids"]) == 24
    assert torch_host["token_ids"] == cpu["token_ids"]


def test_an_mla_model_on_the_metal_composition_names_the_missing_mla_capability_before_reading(tmp_path, monkeypatch):
    """The torch kernels (Metal's whole kernel set) implement no mla_attention: a DeepSeek
    checkpoint is refused at backend selection, naming the capability, before any weight is read."""
    from tests.parity.test_deepseek_vs_transformers import _save

    _, path = _save(tmp_path, "v2-q_proj-dense")
    name = f"zllm_test_torch_host_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN).format(unsupported={}), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    deepseek = [ep for ep in metadata.entry_points(group="zllm") if ep.name == "deepseek"]
    host = PluginHost(entry_points=[*deepseek, metadata.EntryPoint("torch-host", name, "zllm")])
    started = []
    cfg = {"schema_version": 1, "model": {"path": str(path)}, "backend": {"name": "torch-host"}}
    with pytest.raises(CapabilityError) as info:
        zllm.Engine.from_config(cfg, host=host, on_start=started.append)
    assert info.value.missing == ["mla_attention[paged]"] and started == []
    assert "model family 'deepseek'" in str(info.value)
