"""gpt_oss matches HF transformers (``GptOssForCausalLM``) on a tiny random checkpoint that
transformers saves (:mod:`tests.gpt_oss_checkpoint`: fused interleaved ``gate_up_proj``,
sinks, alternating sliding (window 8) and full layers, YaRN, the clamp cutting real
pre-activations), and the GGUF file llama.cpp's own converter writes from it reads as the
same model. The same model with its experts in MXFP4 (``*_blocks`` / ``*_scales``, as the
released gpt-oss files hold them) keeps them MXFP4 in memory and matches transformers, which
dequantizes MXFP4 on a CPU (its ``Mxfp4HfQuantizer`` falls back to ``dequantize`` without a
GPU or the ``kernels`` package; it needs ``accelerate``) — the oracle on the decoded weights.

The prompt (15 tokens) and the 32 greedy tokens run well past the window, so the sliding
layer drops keys a full layer keeps, in prefill and in decode.

Tolerances: f32 -> logits of every prompt position within 1e-4 of the largest logit (~12:
the experts' pre-activations are widened past the clamp) of transformers', 32 greedy tokens
equal to ``generate(do_sample=False)``. bf16 weights -> the same against transformers running
the same (rounded) weights in f32, and within 10% of the largest logit of transformers
running natively in bf16 (which rounds every activation).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

import zllm
from tests.conftest import REPO, write_config
from tests.gpt_oss_checkpoint import save_bf16_copy, save_gpt_oss, save_mxfp4_copy
from tests.parity.hf_models import PROMPT, hf_greedy, hf_logits
from zllm.plugin_api import QuantizedTensor
from zllm.spec.errors import ZllmError
from zllm_backend_cpu.kernels import moe_gemv
from zllm_backend_cpu.kernels.native import unavailable_reason

CONVERTER = REPO / "tests" / "llama_cpp_converter" / "convert_hf_to_gguf.py"


@pytest.fixture(scope="module")
def f32_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss") / "f32"
    return save_gpt_oss(path), path


def _check_logits(ours: torch.Tensor, hf: torch.Tensor) -> None:
    torch.testing.assert_close(ours, hf, atol=1e-4 * float(hf.abs().max()), rtol=0)


def _generate(engine, n: int = 32) -> list[int]:
    out = engine.generate({"prompt_token_ids": PROMPT, "max_tokens": n, "stop_token_ids": [], "ignore_eos": True})
    return out["token_ids"]


def test_f32_logits_and_greedy_tokens_match_transformers(tmp_path, f32_checkpoint):
    model, path = f32_checkpoint
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.family_info.name == "gpt_oss"
    assert [layer.sliding_window for layer in engine.loaded.model.kv_spec.layers] == [8, None]
    _check_logits(engine.prompt_logits(PROMPT), hf_logits(model, PROMPT))
    assert _generate(engine) == hf_greedy(model)


def test_bf16_weights_match_transformers_on_rounded_weights(tmp_path, f32_checkpoint):
    path = save_bf16_copy(f32_checkpoint[1], tmp_path / "bf16")
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.model.layers[0].experts.gate.dtype == torch.bfloat16  # experts stay 16-bit
    ours = engine.prompt_logits(PROMPT)
    rounded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_logits(ours, hf_logits(rounded, PROMPT))
    native = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), PROMPT)
    assert (ours - native).abs().max() <= 0.1 * native.abs().max()


def test_mxfp4_experts_stay_mxfp4_and_match_transformers_dequantizing_them(tmp_path, f32_checkpoint):
    path = save_mxfp4_copy(f32_checkpoint[1], tmp_path / "mxfp4")
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    experts = engine.loaded.model.layers[1].experts
    for stack, shape in ((experts.gate, (4, 32, 64)), (experts.up, (4, 32, 64)), (experts.down, (4, 64, 32))):
        assert isinstance(stack, QuantizedTensor) and stack.fmt == "mxfp4" and stack.shape == shape
    assert "moe_clamped_swiglu[mxfp4]" in {e.capability for e in engine.loaded.ops.explain()}
    _assert_experts_take_one_native_call(engine)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert not hasattr(oracle.model.layers[0].mlp.experts, "gate_up_proj_blocks")  # it dequantized them
    _check_logits(engine.prompt_logits(PROMPT), hf_logits(oracle, PROMPT))
    assert _generate(engine) == hf_greedy(oracle)


def _assert_experts_take_one_native_call(engine) -> None:
    """The MXFP4 experts bound to the native MoE kernel (one call per layer), when the native
    library loads, and every layer's stacks in formats it takes (no per-expert loop)."""
    if unavailable_reason() is not None:
        return
    kernels = {e.capability: e.kernel for e in engine.loaded.ops.explain()}
    assert kernels["moe_clamped_swiglu[mxfp4]"].endswith("moe_clamped_swiglu_gemv"), kernels
    for layer in engine.loaded.model.layers:
        assert moe_gemv.native_formats(layer.experts.gate, layer.experts.up, layer.experts.down, None)


def _convert(path, out):
    proc = subprocess.run([sys.executable, str(CONVERTER), str(path), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow  # one converter run (a few seconds)
def test_gguf_from_llama_cpp_converter_matches_transformers(tmp_path, f32_checkpoint):
    model, path = f32_checkpoint
    out = _convert(path, tmp_path / "gpt-oss-f32.gguf")
    engine = zllm.Engine.from_config(write_config(tmp_path, out))
    assert engine.loaded.family_info.name == "gpt_oss"
    stacked = engine.loaded.model.layers[0].experts
    assert stacked.gate.shape == (4, 32, 64) and stacked.down.shape == (4, 64, 32)  # ffn_*_exps as stored
    _check_logits(engine.prompt_logits(PROMPT), hf_logits(model, PROMPT))
    assert _generate(engine) == hf_greedy(model)
    assert engine.tokenizer.chat_template is not None  # the converter carried the harmony template


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("num_local_experts"), "gpt_oss config lacks required key 'num_local_experts'"),
    (lambda c: c.update(num_experts_per_tok=5), "num_experts_per_tok 5 > num_local_experts 4"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types .* need 2 entries"),
], ids=["no-experts", "k-above-experts", "layer-types-length"])
def test_bad_config_is_a_one_line_error_naming_the_key(tmp_path, f32_checkpoint, edit, message):
    _, path = f32_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ZllmError, match=message) as e:
        zllm.Engine.from_config(write_config(tmp_path, bad))
    assert "\n" not in str(e.value)


def test_a_missing_expert_tensor_is_named(tmp_path, f32_checkpoint):
    from safetensors.torch import load_file, save_file

    _, path = f32_checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).symlink_to(f)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ZllmError, match="model.layers.1.mlp.experts.down_proj_bias"):
        zllm.Engine.from_config(write_config(tmp_path, bad))


@pytest.mark.slow  # one converter run (a few seconds)
def test_gguf_with_ggml_mxfp4_experts_matches_transformers_dequantizing_the_checkpoint(tmp_path, f32_checkpoint):
    """llama.cpp's converter keeps MXFP4 experts MXFP4 (ggml's block layout, nibbles reordered);
    zllm repacks them at load into the registry's ``mxfp4`` parts, still 4-bit."""
    path = save_mxfp4_copy(f32_checkpoint[1], tmp_path / "mxfp4")
    engine = zllm.Engine.from_config(write_config(tmp_path, _convert(path, tmp_path / "gpt-oss-mxfp4.gguf")))
    gate = engine.loaded.model.layers[0].experts.gate
    assert isinstance(gate, QuantizedTensor) and gate.fmt == "mxfp4" and gate.shape == (4, 32, 64)
    _assert_experts_take_one_native_call(engine)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_logits(engine.prompt_logits(PROMPT), hf_logits(oracle, PROMPT))
    assert _generate(engine) == hf_greedy(oracle)
