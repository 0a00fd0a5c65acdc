"""``run_conformance`` in-process: wrong kernels swapped into a real plugin host's registry are
caught and named; what the kit cannot check fails loudly; device-unsupported capabilities are
skipped with their reason, never passed."""

from __future__ import annotations

import attrs
import pytest
import torch

from zllm.capabilities import Capability
from zllm.capabilities.ops import AttentionMetadata
from zllm.conformance import run_conformance
from zllm.conformance.e2e import ModelSource, check_model, write_tiny_checkpoint
from zllm.conformance.kernels import check_kernels
from zllm.domain.activation import silu_mul
from zllm.domain.attention import causal_softmax_attention, first_window_block, gather_context, write_kv
from zllm.domain.rope import apply_rope
from zllm.plugins.host import PluginHost
from zllm.spec.errors import ConfigError
from zllm_backend_cpu.backend import CpuBackend


@pytest.fixture
def host() -> PluginHost:
    return PluginHost(allowlist=["cpu", "llama"])


def rope_rotates_the_wrong_way(x, cos, sin):
    return apply_rope(x, cos, -sin)


def attention_sliding_ignores_the_window(q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int):
    # Reads only the blocks a window keeps (so it never trips on a freed one) but lets every
    # query see all of them: right whenever the window covers the whole context.
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out, start, bs = torch.empty_like(q), 0, k_cache.shape[1]
    for s, (n_q, n_ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        first = first_window_block(n_q, n_ctx, window, bs)
        ks, vs = (gather_context(c, meta.block_tables[s], n_ctx, first) for c in (k_cache, v_cache))
        out[start:start + n_q] = causal_softmax_attention(q[start:start + n_q], ks, vs, meta.scale, None, first * bs)
        start += n_q
    return out


def silu_mul_crashes(gate, up):
    raise RuntimeError("illegal memory access")


def test_replaced_kernel_fails_and_is_named_while_the_rest_pass(host):
    host.kernels.register("rope", "cpu", ("neox",), rope_rotates_the_wrong_way, replace=True, registered_by="test")

    report = run_conformance("cpu", host=host, ops=["rope"], quick=True)

    assert not report.passed
    name = f"{__name__}:rope_rotates_the_wrong_way"
    failed = {(r.kernel, r.capability) for r in report.kernels if r.failed}
    assert failed == {(name, "rope[neox]")}
    assert all(r.passed for r in report.kernels if r.capability == "rope[gptj]")
    assert all(line.startswith(f"FAIL kernel {name} rope[neox] [T=") for line in report.failures())
    assert "elements outside tolerance" in report.failures()[0]


def test_sliding_window_kernel_that_ignores_the_window_is_caught(host):
    host.kernels.register("attention_sliding", "cpu", ("paged",), attention_sliding_ignores_the_window, priority=3)

    report = run_conformance("cpu", host=host, ops=["attention_sliding"], quick=True)

    mine = [r for r in report.kernels if r.kernel.endswith(":attention_sliding_ignores_the_window")]
    assert mine and any(r.failed for r in mine)
    assert all(r.passed for r in report.kernels if r not in mine)  # the CPU backend's own kernels


def test_kernel_that_raises_is_a_failure_with_the_error(host):
    host.kernels.register("silu_mul", "cpu", ("f32",), silu_mul_crashes, priority=2)

    report = run_conformance("cpu", host=host, ops=["silu_mul"], quick=True)

    crashed = [r for r in report.kernels if r.kernel.endswith(":silu_mul_crashes")]
    assert crashed
    assert all(r.failed and r.detail.startswith("raised RuntimeError: illegal memory access") for r in crashed)
    assert all(r.max_abs_err == float("inf") for r in crashed)


def test_op_without_a_case_generator_fails_instead_of_being_skipped(host):
    host.kernels.register("softcap", "cpu", ("f32",), torch.tanh)

    report = run_conformance("cpu", host=host, ops=["softcap"])

    (result,) = report.kernels
    assert result.failed and result.capability == "softcap[f32]"
    assert "no case generator for op 'softcap'" in result.detail


def test_declared_capability_without_a_kernel_fails(host):
    info = host.backends["cpu"]
    host.backends["cpu"] = attrs.evolve(info, capabilities=info.capabilities | {Capability("silu_mul", "f16")})

    report = run_conformance("cpu", host=host, ops=["silu_mul"], quick=True)

    (missing,) = [r for r in report.kernels if r.failed]
    assert missing.capability == "silu_mul[f16]" and "declares silu_mul[f16] but registers no kernel" in missing.detail


def test_every_registry_entry_of_the_backend_is_checked_and_models_it_cannot_run_are_skipped(host):
    # A backend with two silu_mul kernels (the batch-invariant one at a lower priority) and
    # nothing else: both are checked; no model can run on it, so each is skipped, not passed.
    host.backends["mini"] = attrs.evolve(host.backends["cpu"], name="mini",
                                         capabilities=frozenset({Capability("silu_mul", "f32")}))
    host.kernels.register("silu_mul", "mini", ("f32",), silu_mul)
    host.kernels.register("silu_mul", "mini", ("f32",), "zllm.domain.activation:silu_mul", priority=-1,
                          batch_invariant=True)

    report = run_conformance("mini", host=host, quick=True)

    kernels = [(r["kernel"], r["priority"], r["batch_invariant"]) for r in report.kernel_summary()]
    name = "zllm.domain.activation:silu_mul"
    assert sorted(kernels) == [(name, -1, True), (name, 0, False)]
    assert report.passed
    assert [m.status for m in report.e2e] == ["skipped"] * 3
    assert all("does not declare" in m.detail for m in report.e2e)


class CpuBackendWithoutBf16(CpuBackend):
    """The CPU backend, claiming its device lacks bf16 (as a GPU before sm_80 would)."""

    def unsupported_capabilities(self) -> dict[str, str]:
        return {"linear[bf16]": "no bf16 on this device", "embedding[bf16]": "no bf16 on this device"}


def test_capabilities_the_device_cannot_run_are_skipped_with_the_reason(host, tmp_path):
    backend = CpuBackendWithoutBf16(threads=1)

    results = check_kernels(host.kernels, host.backends["cpu"], backend, seed=0, quick=True, ops={"linear"})

    bf16 = [r for r in results if r.capability == "linear[bf16]"]
    assert bf16 and all(r.status == "skipped" and "no bf16 on this device" in r.detail for r in bf16)
    assert all(r.passed for r in results if r.capability != "linear[bf16]")
    model = ModelSource("tiny", write_tiny_checkpoint(tmp_path / "tiny", seed=0, sliding_window=None))
    result = check_model(host, host.backends["cpu"], backend, model, dtype="bf16")
    assert result.status == "skipped" and "embedding[bf16] (no bf16 on this device)" in result.detail


def test_unknown_ops_and_dtype_are_usage_errors(host):
    with pytest.raises(ConfigError, match=r"--ops: bogus matches no op backend 'cpu' registers"):
        run_conformance("cpu", host=host, ops=["rope", "bogus"])
    with pytest.raises(ConfigError, match=r"--dtype: unknown dtype 'f8'"):
        run_conformance("cpu", host=host, dtype="f8")


def test_stories260k_not_found_is_reported_as_skipped_not_passed(host, tmp_path):
    from zllm.conformance.e2e import default_models

    sources = default_models(tmp_path / "models", seed=0, roots=[tmp_path])

    stories = next(s for s in sources if s.name == "stories260k")
    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), stories)
    assert result.status == "skipped" and result.path is None
    assert result.detail.startswith(f"not found (looked for {tmp_path}/assets/models/stories260k/hf)")


def rms_norm_ignores_weight(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


@pytest.fixture
def tiny(tmp_path):
    return ModelSource("tiny", write_tiny_checkpoint(tmp_path / "tiny", seed=0, sliding_window=None))


def test_wrong_kernel_fails_the_end_to_end_check(host, tiny):
    # outranks every shipped kernel
    host.kernels.register("rms_norm", "cpu", ("f32",), rms_norm_ignores_weight, priority=10)

    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), tiny)

    assert result.status == "failed" and result.mode == "exact"
    assert "elements outside tolerance" in result.detail or "differs" in result.detail


def test_16_bit_weights_are_judged_by_top1_agreement(host, tiny):
    result = check_model(host, host.backends["cpu"], CpuBackend(threads=1), tiny, dtype="bf16", new_tokens=4)

    assert result.status == "passed" and result.mode == "top1", result
    assert result.top1_agreement >= result.threshold == 0.9
    assert len(result.tokens) == len(result.reference_tokens) == 4


def test_device_is_passed_to_the_backend_constructor(host):
    report = run_conformance("cpu", host=host, device="cpu", ops=["rope"], quick=True)

    assert report.passed and report.device == "cpu" and report.settings["device"] == "cpu"
    with pytest.raises(ConfigError, match=r"--device: backend 'cpu': .*got 'mps'"):
        run_conformance("cpu", host=host, device="mps", ops=["rope"])
