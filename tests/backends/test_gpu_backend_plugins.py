"""The cuda, rocm and metal backend plugins on a machine without their devices.

What must hold here: they are discovered and say why they cannot run, they declare exactly
the kernels they register (Triton for the ops zllm-kernels-triton covers, torch for the
rest), an explicit choice fails at start with the backend's own reason and never falls back,
``auto`` skips them with those reasons, ``force_reference`` binds the f32 reference on each,
and the per-device capability decisions (bf16) give the documented answers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import MODEL_DIR, write_config
from tests.gpt_oss_checkpoint import CONFIG as GPT_OSS_CONFIG
from tests.gpt_oss_checkpoint import save_mxfp4_copy
from zllm import Engine
from zllm.capabilities import Capability
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost
from zllm.plugins.selection import select_backend
from zllm.spec.errors import BackendUnavailable, CapabilityError
from zllm_backend_cuda.backend import CudaBackend
from zllm_backend_cuda.backend import bf16_unsupported as cuda_bf16_unsupported
from zllm_backend_metal.backend import MetalBackend
from zllm_backend_metal.backend import bf16_unsupported as metal_bf16_unsupported
from zllm_backend_rocm.backend import RocmBackend
from zllm_backend_rocm.backend import bf16_unsupported as rocm_bf16_unsupported
from zllm_backend_rocm.tuning import ROCM_TUNING
from zllm_kernels_triton import OPS

REASONS = {
    "cuda": "no CUDA device visible (torch.cuda.is_available() is False)",
    "rocm": "this torch is not a ROCm build (torch.version.hip is None)",
    "metal": "no Metal device visible (torch.backends.mps.is_available() is False)",
}
GPU_CAPABILITIES = {f"embedding[{f}]" for f in ("f32", "f16", "bf16", "q8_0")} | {
    f"linear[{f}]" for f in ("f32", "f16", "bf16", "q8_0")} | {
    "rms_norm[f32]", "add_rms_norm[f32]", "rope[neox]", "rope[gptj]", "silu_mul[f32]", "attention[paged]",
    "attention_sliding[paged]"}
#: What the cuda and rocm backends add through zllm-kernels-triton alone (metal has none of them).
HF_FORMATS = ("fp8_e4m3", "int4_g", "int8_g", "mxfp4", "nvfp4")
TRITON_ONLY_CAPABILITIES = {
    f"{op}[{f}]" for op in ("moe", "moe_clamped_swiglu") for f in ("f32", "f16", "bf16", "q8_0", *HF_FORMATS)} | {
    "mla_attention[paged]", "attention_sinks[paged]", "swiglu_clamped[f32]", "router_topk_softmax[f32]"} | {
    f"linear[{f}]" for f in HF_FORMATS}
TRITON_CAPABILITIES = {f"{op}[{v}]" for op, variants, _ in OPS for v in variants}
#: The reasons above describe this machine: no GPU, a CPU build of torch.
without_gpus = pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                                  reason="a GPU is visible: the expected reasons describe a machine without one")
LLAMA_F32_NEEDS = frozenset(Capability.parse(c) for c in (
    "embedding[f32]", "linear[f32]", "rms_norm[f32]", "add_rms_norm[f32]", "rope[neox]", "attention[paged]",
    "silu_mul[f32]"))


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost()


@without_gpus
def test_plugins_lists_each_gpu_backend_as_loaded_with_its_unavailable_reason():
    proc = zllm("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    for name, reason in REASONS.items():
        assert rows[name]["distribution"] == f"zllm-backend-{name}"
        assert rows[name]["kind"] == f"backend:{name}"
        assert rows[name]["status"] == "loaded"
        assert rows[name]["reason"] == f"backend {name} unavailable: {reason}"
    assert rows["cpu"]["reason"] == ""


@without_gpus
@pytest.mark.parametrize("name", sorted(REASONS))
def test_backend_class_reports_its_reason_without_a_device(host, name):
    assert host.backends[name].load_class().unavailable_reason() == REASONS[name]


@pytest.mark.parametrize("name", sorted(REASONS))
def test_each_gpu_backend_declares_the_documented_capabilities_and_registers_exactly_them(host, name):
    info = host.backends[name]
    entries = [e for e in host.kernels.entries() if e.backend == name]
    registered = {f"{e.op}[{f}]": e for e in entries for f in e.formats}
    expected_caps = GPU_CAPABILITIES | (TRITON_ONLY_CAPABILITIES if name != "metal" else set())
    assert {str(c) for c in info.capabilities} == set(registered) == expected_caps
    # cuda and rocm: Triton wherever zllm-kernels-triton has the op, torch elsewhere; metal: torch only
    triton_side = TRITON_CAPABILITIES if name != "metal" else set()
    for cap, entry in registered.items():
        expected = f"zllm_backend_{name}.kernels:" if cap in triton_side else "zllm_kernels_torch."
        assert entry.name.startswith(expected), (cap, entry.name)
        assert entry.registered_by == f"zllm-backend-{name}"
    assert info.priority > host.backends["cpu"].priority


@without_gpus
@pytest.mark.parametrize("name", sorted(REASONS))
def test_config_naming_a_gpu_backend_fails_at_start_with_its_reason(tmp_path, name):
    cfg = write_config(tmp_path, MODEL_DIR / "hf", backend={"name": name})
    line = one_line_error(zllm("run", "--config", cfg, "--max-new-tokens", "2"))
    assert line == f"error: backend {name}: {REASONS[name]}"


@without_gpus
def test_auto_selection_skips_the_gpu_backends_with_their_reasons(host):
    choice = select_backend(host, "auto", LLAMA_F32_NEEDS, "llama")
    assert choice.info.name == "cpu"
    # highest priority first: cuda and rocm (20), then metal (10)
    assert choice.reason.endswith(
        f"; skipped cuda: {REASONS['cuda']}; rocm: {REASONS['rocm']}; metal: {REASONS['metal']}")


@without_gpus
def test_a_gpt_oss_checkpoint_with_mxfp4_experts_clears_the_capability_check_of_cuda_and_rocm(tmp_path):
    # As released: MXFP4 experts, everything else dense. cuda and rocm take the experts through
    # zllm-kernels-triton's moe_clamped_swiglu[mxfp4], so only the absent device stops them;
    # metal has no MoE kernel and names it, before a weight is read (so no tokenizer is needed).
    config = transformers.AutoConfig.for_model("gpt_oss", **GPT_OSS_CONFIG)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "f32")
    path = save_mxfp4_copy(tmp_path / "f32", tmp_path / "mxfp4")
    for name in ("cuda", "rocm"):
        with pytest.raises(BackendUnavailable, match=re.escape(REASONS[name])):
            Engine.from_config({"schema_version": 1, "model": {"path": str(path)}, "backend": {"name": name}})
    started = []
    with pytest.raises(CapabilityError) as info:
        Engine.from_config({"schema_version": 1, "model": {"path": str(path)}, "backend": {"name": "metal"}},
                                on_start=started.append)
    assert "moe_clamped_swiglu[mxfp4]" in info.value.missing and started == []


@pytest.mark.parametrize("name", sorted(REASONS))
@pytest.mark.parametrize("op", ["linear", "attention", "rope"])
def test_force_reference_binds_the_f32_reference_on_every_gpu_backend(host, name, op):
    ops = BoundOps(host.kernels, name, LLAMA_F32_NEEDS, force_reference=[op], ops=host.ops)
    for cap, choice in ops.choices.items():
        if cap.op == op:
            assert choice.entry.backend == "reference" and choice.entry.registered_by == "zllm-core"
            assert f"instead of backend {name!r}" in choice.reason
        else:
            assert choice.entry.backend == name


@without_gpus
@pytest.mark.parametrize(("cls", "device", "message"), [
    (CudaBackend, None, "backend cuda: device 'cuda:0' (the default) does not exist; visible cuda devices: none"),
    (RocmBackend, "cuda:3", "backend rocm: device 'cuda:3' does not exist; visible cuda devices: none"),
    (CudaBackend, "mps", "'mps' is not a 'cuda' device"),
    (MetalBackend, "cuda:0", "'cuda:0' is not a 'mps' device"),
    (CudaBackend, "gpu one", "'gpu one' is not a torch device string"),
])
def test_a_device_argument_the_backend_cannot_use_is_a_value_error_naming_it(cls, device, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(device=device)


def test_cuda_withdraws_bf16_below_sm_80_naming_the_gpu():
    assert cuda_bf16_unsupported((8, 0), "NVIDIA A100") == {}
    assert cuda_bf16_unsupported((9, 0), "NVIDIA H200") == {}
    why = "bf16 weights need compute capability 8.0 (sm_80) or newer; Tesla T4 is sm_75"
    assert cuda_bf16_unsupported((7, 5), "Tesla T4") == {"embedding[bf16]": why, "linear[bf16]": why}


@pytest.mark.parametrize(("arch", "has_bf16"), [
    ("gfx90a:sramecc+:xnack-", True), ("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx1100", True),
    ("gfx1201", True), ("gfx908:sramecc+:xnack-", False), ("gfx906", False), ("gfx1030", False),
])
def test_rocm_withdraws_bf16_on_arches_without_bf16_matrix_instructions(arch, has_bf16):
    unsupported = rocm_bf16_unsupported(arch)
    assert (unsupported == {}) == has_bf16
    if not has_bf16:
        assert set(unsupported) == {"embedding[bf16]", "linear[bf16]"}
        assert unsupported["linear[bf16]"].endswith(f"this GPU is {arch.split(':')[0]}")


def test_metal_withdraws_bf16_before_macos_14():
    assert metal_bf16_unsupported(True) == {}
    assert metal_bf16_unsupported(False) == dict.fromkeys(["embedding[bf16]", "linear[bf16]"],
                                                          "bf16 on MPS needs macOS 14 or newer")


def test_rocm_tuning_spreads_lanes_in_whole_64_wide_wavefronts():
    lane_tiles = ("norm_block_k", "rope_block_pairs", "silu_block_n", "decode_block_n", "prefill_block_m",
                  "prefill_block_n", "linear_block_n", "linear_block_k")
    assert {f: getattr(ROCM_TUNING, f) % 64 for f in lane_tiles} == dict.fromkeys(lane_tiles, 0)
