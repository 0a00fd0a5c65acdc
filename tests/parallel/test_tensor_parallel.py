"""Tensor parallelism over real processes (gloo on 127.0.0.1, ``OMP_NUM_THREADS=1``):
stories260K reproduces its published greedy output with TP = 2, tiny transformers-made
checkpoints give TP = 1's greedy tokens and last-position logits within 1e-4 relative (TP
sums in another order, so it is not bit-exact), and sizes that do not fit are refused
before any process starts or weight is read."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers

import zllm
from tests.conftest import MODEL_DIR, REFERENCE_TEXT, write_config
from tests.gguf_files import requantize
from tests.gpt_oss_checkpoint import VOCAB as GPT_OSS_VOCAB
from tests.gpt_oss_checkpoint import save_gpt_oss
from tests.parity.hf_models import PROMPT, save_widened
from tests.parity.test_deepseek_vs_transformers import _save as save_deepseek
from tests.parity.test_families_vs_transformers import _write_gguf
from zllm.spec.errors import ConfigError, TensorError

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2)

# case -> (transformers config class, model class, overrides): each covers several of the
# ways heads, KV heads, vocabulary and FFN are split (stories260K above: 4 KV heads split, tied).
CASES = {
    "qwen3-qknorm-gqa1-untied-odd-vocab": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                                           dict(num_key_value_heads=1, vocab_size=513, head_dim=16,
                                                tie_word_embeddings=False)),
    "mistral-sliding-window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                               dict(sliding_window=6, tie_word_embeddings=False)),
    "qwen2_moe-shared-expert": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                                dict(moe_intermediate_size=32, num_experts_per_tok=2, num_experts=4,
                                     shared_expert_intermediate_size=48, norm_topk_prob=False)),
}


@pytest.fixture
def one_thread(monkeypatch):
    # Spawned ranks inherit it: two ranks on two cores, one thread each.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _greedy(engine, n: int = 24) -> list[int]:
    return engine.generate({"prompt_token_ids": PROMPT, "max_tokens": n, "stop_token_ids": [],
                            "ignore_eos": True})["token_ids"]


def test_stories260k_with_two_ranks_prints_its_published_greedy_story_and_stops_them(tmp_path):
    cfg = write_config(tmp_path, MODEL_DIR / "hf", parallel={"tensor": 2})
    with zllm.Engine.from_config(cfg) as engine:
        assert engine.ranks is not None and [p.is_alive() for p in engine.ranks.procs] == [True]
        out = engine.generate({"prompt": "", "max_tokens": 200})
        procs = engine.ranks.procs
    assert out["text"].startswith(REFERENCE_TEXT), out["text"]
    assert [p.exitcode for p in procs] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_one_rank_greedy_tokens_and_logits(tmp_path, case):
    config_cls, model_cls, overrides = CASES[case]
    path = tmp_path / case
    save_widened(path, model_cls, config_cls(**{**BASE, **overrides}), sum(map(ord, case)))
    _check_two_ranks_match_one(tmp_path, path, overrides.get("vocab_size", 512))


@pytest.mark.slow
def test_deepseek_mla_moe_with_two_ranks_gives_one_rank_greedy_tokens_and_logits(tmp_path):
    # q_lora, MoE layer with grouped routing, correction bias and a shared expert; the latent
    # cache replicated, heads and every expert's width split.
    _model, path = save_deepseek(tmp_path, "v3-moe-grouped-bias-norm")
    _check_two_ranks_match_one(tmp_path, path, 512)


@pytest.mark.slow
def test_gpt_oss_with_two_ranks_gives_one_rank_greedy_tokens_and_logits(tmp_path):
    # Query heads split with their sinks and q/k/v bias rows, the two KV heads split, o_proj's
    # and the experts' down biases added once; every expert split by its width, the router whole.
    save_gpt_oss(tmp_path / "gpt_oss", biased=True)
    _check_two_ranks_match_one(tmp_path, tmp_path / "gpt_oss", GPT_OSS_VOCAB)


def _check_two_ranks_match_one(tmp_path: Path, path: Path, vocab: int) -> None:
    (tmp_path / "tp1").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "tp1", path)) as one:
        logits_1, tokens_1 = one.prompt_logits(PROMPT)[-1], _greedy(one)
    (tmp_path / "tp2").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "tp2", path, parallel={"tensor": 2})) as two:
        logits_2, tokens_2 = two.prompt_logits(PROMPT)[-1], _greedy(two)
    assert tokens_2 == tokens_1
    assert logits_2.shape == logits_1.shape == (vocab,)
    torch.testing.assert_close(logits_2, logits_1, rtol=0, atol=1e-4 * logits_1.abs().max().item())


# --- sizes that do not fit: refused before any rank starts ---------------------------------


def _refused(cfg_path: Path) -> BaseException:
    before = set(multiprocessing.active_children())
    with pytest.raises((ConfigError, TensorError)) as exc:
        zllm.Engine.from_config(cfg_path)
    assert set(multiprocessing.active_children()) == before, "no rank may start for a config that cannot run"
    return exc.value


def test_tensor_size_that_does_not_divide_the_heads_names_both_numbers(tmp_path):
    err = _refused(write_config(tmp_path, MODEL_DIR / "hf", parallel={"tensor": 3}))
    assert isinstance(err, ConfigError) and err.path == "parallel.tensor"
    assert "3 does not divide the 8 attention heads" in str(err)


def test_pipeline_longer_than_the_layers_names_both_numbers(tmp_path):
    err = _refused(write_config(tmp_path, MODEL_DIR / "hf", parallel={"pipeline": 6}))
    assert isinstance(err, ConfigError) and err.path == "parallel.pipeline"
    assert "6 stages exceed the 5 layers" in str(err)


def test_quantized_row_parallel_slice_off_its_blocks_is_refused_naming_the_tensor(tmp_path):
    # FFN width 96 is three Q8_0 blocks of 32; two ranks would hold 48 columns of down_proj each.
    model = save_widened(tmp_path / "hf", transformers.LlamaForCausalLM, transformers.LlamaConfig(**BASE), 7)
    f32 = _write_gguf(model, tmp_path / "f32.gguf", "llama")
    q8 = requantize(f32, tmp_path / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    err = _refused(write_config(tmp_path, q8, parallel={"tensor": 2}))
    assert isinstance(err, TensorError)
    assert "model.layers.0.mlp.down_proj.weight" in str(err) and "48 of its 96 columns" in str(err)


def test_a_rank_that_cannot_reach_the_rendezvous_exits_naming_the_setting(tmp_path, free_port):
    cfg = write_config(tmp_path, MODEL_DIR / "hf", parallel={"tensor": 2, "startup_timeout_s": 2})
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
    proc = subprocess.run([sys.executable, "-m", "zllm", "run", "--config", str(cfg)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "parallel.startup_timeout_s: rank 1 could not join" in proc.stderr
    assert proc.stdout == ""


@pytest.fixture
def free_port() -> int:
    from zllm.engine.distributed import free_port as pick

    return pick()
