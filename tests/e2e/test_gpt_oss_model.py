"""A gpt-oss checkpoint runs end to end with no special case: chat requests rendered by its
harmony-style template (the ids transformers' ``apply_chat_template`` gives, the assistant's
turn ending at ``<|return|>``, the model's EOS), a second turn reusing the first turn's cache
past the sliding window, concurrent chunked requests in batch-invariant mode equal to each
request alone, and ``zllm run --chat`` / ``--explain`` from the command line."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
import transformers

import zllm
from tests.cli.conftest import ZLLM
from tests.concurrent_requests import run_together
from tests.conftest import REPO, write_config
from tests.gpt_oss_checkpoint import CHAT_TEMPLATE, RETURN_ID, save_gpt_oss

MESSAGES = [{"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss") / "ckpt"
    save_gpt_oss(path)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    cfg = write_config(tmp_path_factory.mktemp("cfg"), checkpoint, generation={"temperature": 0.0},
                       runtime={"kv_cache": {"block_size": 4}})
    return zllm.Engine.from_config(cfg)


def test_chat_messages_render_the_harmony_template_as_transformers_does(engine, checkpoint):
    tf = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    out = tf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    tf_ids = list(out["input_ids"] if "input_ids" in out else out)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    assert engine.prompt_ids(engine.parse({"messages": MESSAGES})) == tf_ids
    assert tf.decode(tf_ids).endswith("<|start|>assistant<|channel|>final<|message|>")
    chat = engine.generate({"messages": MESSAGES, "max_tokens": 12})
    ids = engine.generate({"prompt_token_ids": tf_ids, "max_tokens": 12})
    assert chat["token_ids"] == ids["token_ids"] and len(chat["token_ids"]) > 0
    assert RETURN_ID in engine.loaded.eos_token_ids


def test_second_turn_reuses_the_first_turns_cache_past_the_window(engine):
    first = engine.generate({"messages": MESSAGES, "max_tokens": 10, "ignore_eos": True})
    turns = [*MESSAGES, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]
    second = engine.generate({"messages": turns, "max_tokens": 10, "ignore_eos": True})
    assert second["usage"]["cached_tokens"] >= 8  # whole blocks of the first turn, longer than the window
    fresh = engine.generate({"prompt_token_ids": engine.prompt_ids(engine.parse({"messages": turns})),
                             "max_tokens": 10, "ignore_eos": True})
    assert second["token_ids"] == fresh["token_ids"]


def test_concurrent_chunked_requests_in_batch_invariant_mode_equal_each_request_alone(checkpoint, tmp_path):
    engine = zllm.Engine.from_config(write_config(
        tmp_path, checkpoint, runtime={"batch_invariant": True, "max_prefill_tokens": 8, "prefix_cache_seqs": 0}))
    chosen = {e.capability: e.kernel for e in engine.loaded.ops.explain()}
    assert all("invariant" in chosen[c] for c in ("attention_sinks[paged]", "router_topk_softmax[f32]",
                                                  "moe_clamped_swiglu[f32]"))
    prompts = ["The sea was calm", "Once upon a time there was a lighthouse keeper who", "Waves", "A ship"]
    reqs = [{"prompt": p, "max_tokens": 12 + 3 * i, "ignore_eos": True} for i, p in enumerate(prompts)]
    together = run_together(engine, reqs)
    alone = [engine.generate(r)["token_ids"] for r in reqs]
    assert together == alone
    assert [len(t) for t in together] == [r["max_tokens"] for r in reqs]


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([*ZLLM, "run", *args], input=stdin, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two CLI processes (imports and a load each)
def test_zllm_run_chat_and_explain_name_the_gpt_oss_kernels(checkpoint, tmp_path):
    cfg = str(write_config(tmp_path, checkpoint))
    chat = _run("--config", cfg, "--chat", "--max-new-tokens", "6", "--temperature", "0",
                stdin="Tell me about the sea.\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()
    explain = _run("--config", cfg, "--explain", "--prompt", "The sea", "--max-new-tokens", "2")
    assert explain.returncode == 0, explain.stderr
    for capability in ("attention_sinks[paged]", "router_topk_softmax[f32]", "moe_clamped_swiglu[f32]"):
        assert capability in explain.stdout + explain.stderr


def test_fp8_attention_with_dense_experts_runs_the_experts_as_saved(checkpoint, tmp_path):
    # An FP8 quantizer targets Linear modules and leaves the fused expert parameters dense in
    # transformers' x @ W layout; any quantization_config was read as MXFP4 row-layout experts
    # ("mis-shaped" down_proj, or silently transposed square experts).
    from safetensors.torch import load_file, save_file

    from zllm.conformance.quantizers import quantize_fp8_e4m3
    from zllm.domain.quant import dequantize

    fp8, dense = tmp_path / "fp8", tmp_path / "dense"
    shutil.copytree(checkpoint, fp8)
    shutil.copytree(checkpoint, dense)
    tensors = load_file(checkpoint / "model.safetensors")
    fp8_tensors, dense_tensors = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith("self_attn.q_proj.weight"):
            q = quantize_fp8_e4m3(w.float(), None)
            fp8_tensors[name] = q.parts["qweight"].view(torch.float8_e4m3fn)
            fp8_tensors[name.removesuffix("weight") + "weight_scale_inv"] = q.parts["scale"].reshape(())
            dense_tensors[name] = dequantize(q).to(w.dtype)
    save_file(fp8_tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dense_tensors, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "modules_to_not_convert": ["lm_head"]}
    (fp8 / "config.json").write_text(json.dumps(config))

    request = {"prompt_token_ids": [5, 6, 7], "max_tokens": 6, "stop_token_ids": []}
    outs = []
    for d in (fp8, dense):
        with zllm.Engine.from_config(write_config(tmp_path / d.name, d)) as engine:
            outs.append(engine.generate(request)["token_ids"])
    assert outs[0] == outs[1]
