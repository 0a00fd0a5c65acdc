"""Pipeline parallelism over real processes (gloo on 127.0.0.1, ``OMP_NUM_THREADS=1``):
contiguous stages pass hidden state and residual on, a step's sequences run as micro-batches,
and the tokens and logits are those of one process; TP = 2 x PP = 2 over four processes
(correctness only on two cores)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import zllm
from tests.concurrent_requests import run_together
from tests.conftest import MODEL_DIR, REFERENCE_TEXT, write_config
from tests.gpt_oss_checkpoint import save_gpt_oss
from tests.parity.hf_models import PROMPT, save_widened
from tests.parity.test_deepseek_vs_transformers import _save as save_deepseek
from zllm.capabilities.ops import AttentionMetadata
from zllm.capabilities.parallel import ParallelContext
from zllm.engine.distributed import micro_batches
from zllm.spec.errors import ConfigError

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [PROMPT, PROMPT[:5], [1, 77, 300], PROMPT[3:]]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 4), st.data())
@settings(max_examples=60, deadline=None)
def test_micro_batches_cover_the_step_in_whole_sequences(query_lens, count, data):
    rows = sum(query_lens)
    logits = sorted(data.draw(st.sets(st.integers(0, rows - 1))))
    meta = AttentionMetadata(slot_mapping=torch.arange(rows), block_tables=torch.arange(len(query_lens))[:, None],
                             query_lens=tuple(query_lens), context_lens=tuple(n + 3 for n in query_lens), scale=1.0)
    batches = micro_batches(meta, torch.tensor(logits, dtype=torch.int64), count)
    assert 1 <= len(batches) <= min(count, len(query_lens))
    assert [b.rows.start for b in batches] == [0, *(b.rows.stop for b in batches[:-1])]
    assert batches[-1].rows.stop == rows
    assert [b.seqs.start for b in batches] == [0, *(b.seqs.stop for b in batches[:-1])]
    for b in batches:
        assert sum(b.meta.query_lens) == b.rows.stop - b.rows.start
        assert b.meta.block_tables.tolist() == [[s] for s in range(b.seqs.start, b.seqs.stop)]
        assert b.meta.slot_mapping.tolist() == list(range(b.rows.start, b.rows.stop))
    assert [b.rows.start + i for b in batches for i in b.logits_indices.tolist()] == logits


def test_stages_hold_contiguous_layers_differing_by_at_most_one():
    stages = [ParallelContext(pp_rank=r, pp_size=3).stage_layers(8) for r in range(3)]
    assert [list(s) for s in stages] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_stories260k_with_two_stages_prints_its_published_greedy_story(tmp_path):
    with zllm.Engine.from_config(write_config(tmp_path, MODEL_DIR / "hf", parallel={"pipeline": 2})) as engine:
        out = engine.generate({"prompt": "", "max_tokens": 200})
        procs = engine.ranks.procs
    assert out["text"].startswith(REFERENCE_TEXT), out["text"]
    assert [p.exitcode for p in procs] == [0]


@pytest.mark.slow
def test_concurrent_requests_in_micro_batches_equal_one_process(tmp_path):
    path = tmp_path / "qwen3"
    save_widened(path, transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**BASE, head_dim=16), 11)
    reqs = [{"prompt_token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in PROMPTS]
    (tmp_path / "one").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "one", path)) as one:
        logits_1, solo = one.prompt_logits(PROMPT)[-1], [one.generate(r)["token_ids"] for r in reqs]
    (tmp_path / "pp").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "pp", path, parallel={"pipeline": 2})) as pp:
        logits_2, together = pp.prompt_logits(PROMPT)[-1], run_together(pp, reqs)
    assert together == solo
    torch.testing.assert_close(logits_2, logits_1, rtol=0, atol=1e-4 * logits_1.abs().max().item())


@pytest.mark.slow
def test_gpt_oss_with_two_stages_gives_one_stage_greedy_tokens_and_logits(tmp_path):
    # Four layers alternating sliding and full: each stage holds one of each, so the stages' KV
    # caches evict alike (two layers would put a sliding stage beside a full one: refused).
    save_gpt_oss(tmp_path / "gpt_oss", biased=True, num_hidden_layers=4)
    _check_two_stages_match_one(tmp_path, tmp_path / "gpt_oss")


@pytest.mark.slow
def test_deepseek_with_two_stages_gives_one_stage_greedy_tokens_and_logits(tmp_path):
    # A dense MLA layer on the first stage, an MoE one (grouped routing, shared expert) on the last.
    _model, path = save_deepseek(tmp_path, "v3-moe-grouped-bias-norm")
    _check_two_stages_match_one(tmp_path, path)


def _check_two_stages_match_one(tmp_path, path) -> None:
    req = {"prompt_token_ids": PROMPT, "max_tokens": 16, "ignore_eos": True, "stop_token_ids": []}
    (tmp_path / "one").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "one", path)) as one:
        logits_1, tokens_1 = one.prompt_logits(PROMPT)[-1], one.generate(req)["token_ids"]
    (tmp_path / "pp").mkdir()
    with zllm.Engine.from_config(write_config(tmp_path / "pp", path, parallel={"pipeline": 2})) as pp:
        logits_2, tokens_2 = pp.prompt_logits(PROMPT)[-1], pp.generate(req)["token_ids"]
    assert tokens_2 == tokens_1
    torch.testing.assert_close(logits_2, logits_1, rtol=0, atol=1e-4 * logits_1.abs().max().item())


@pytest.mark.slow
def test_two_stages_of_two_tensor_ranks_print_the_story(tmp_path):
    cfg = write_config(tmp_path, MODEL_DIR / "hf", parallel={"pipeline": 2, "tensor": 2})
    with zllm.Engine.from_config(cfg) as engine:
        out = engine.generate({"prompt": "", "max_tokens": 40})
        procs = engine.ranks.procs
    assert REFERENCE_TEXT.startswith(out["text"]) and len(out["text"]) > 100
    assert [p.exitcode for p in procs] == [0, 0, 0]


def test_stages_that_mix_sliding_and_full_layers_are_refused_before_any_rank_starts(tmp_path):
    path = tmp_path / "qwen2"
    config = transformers.Qwen2Config(**{**BASE, "num_hidden_layers": 2}, use_sliding_window=True, sliding_window=5,
                                      layer_types=["sliding_attention", "full_attention"])
    save_widened(path, transformers.Qwen2ForCausalLM, config, 5)
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError) as exc:
        zllm.Engine.from_config(write_config(tmp_path, path, parallel={"pipeline": 2}))
    assert exc.value.path == "parallel.pipeline"
    assert "(layers 0-0: window 5; layers 1-1: full attention)" in str(exc.value)
    assert set(multiprocessing.active_children()) == before, "refused before any rank starts"


@pytest.mark.parametrize(("parallel", "world", "message"), [
    ({"pipeline": 6}, 6, "parallel.pipeline: 6 stages exceed the 5 layers"),
    ({"tensor": 2}, 3, "parallel.tensor: parallel.tensor 2 x parallel.pipeline 1 needs 2 processes, but 3 were "
                       "started"),
])
def test_a_torchrun_rank_refuses_sizes_that_do_not_fit_before_joining(tmp_path, parallel, world, message):
    # What every rank of `torchrun --nproc-per-node N -m zllm run` sees: torchrun's variables.
    cfg = write_config(tmp_path, MODEL_DIR / "hf", parallel=parallel)
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": str(world), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # nobody listens there: joining would fail otherwise
    proc = subprocess.run([sys.executable, "-m", "zllm", "run", "--config", str(cfg)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
