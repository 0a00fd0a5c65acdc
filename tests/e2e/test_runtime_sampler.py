"""The runtime's sampler on the shipped model (stories260K): seeded requests keep the tokens
the backend ``sample`` kernels drew, logprobs are the log-softmax of the model's own logits,
the per-sequence logits mask confines every token, and batch-invariant mode gives a request
the same bits in any batch.

``seeded_outputs.json`` holds the token ids of four seeded requests (top-p, top-k + min-p,
all three penalties, a seed above 2**63) as zllm at commit a6ec9be generated them — before
the sampler moved into the runtime, when the CPU backend's ``sample`` kernel drew them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zllm
from tests.conftest import CONFIGS, MODEL_DIR, write_config
from zllm.runtime.sampler import LOGPROB_FLOOR

SEEDED = json.loads((Path(__file__).parent / "seeded_outputs.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def engine():
    return zllm.Engine.from_config(CONFIGS / "stories260k-hf.yaml")


@pytest.mark.parametrize("case", SEEDED, ids=[str(c["request"]) for c in SEEDED])
def test_seeded_requests_draw_the_tokens_the_backend_sampler_drew(engine, case):
    assert engine.generate(case["request"])["token_ids"] == case["token_ids"]


def _raw_logprobs(engine, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """f64 log-softmax of the logits each output token was sampled from: ``[N, V]``."""
    logits = engine.prompt_logits(prompt_ids + output_ids[:-1])  # [P + N - 1, V]
    return torch.log_softmax(logits[len(prompt_ids) - 1:].double(), dim=-1)


@pytest.mark.parametrize("request_fields", [
    {"temperature": 0.0},
    {"temperature": 1.3, "top_k": 5, "repetition_penalty": 1.5, "seed": 9},  # settings do not change the logprobs
])
def test_logprobs_are_the_log_softmax_of_the_models_logits(engine, request_fields):
    prompt = engine.tokenizer.encode("Once upon a time")
    out = engine.generate({"prompt_token_ids": prompt, "max_tokens": 12, "ignore_eos": True, "logprobs": 4,
                           **request_fields})
    expected = _raw_logprobs(engine, prompt, out["token_ids"])
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    for i, entry in enumerate(out["logprobs"]):
        assert entry["logprob"] == pytest.approx(float(expected[i, entry["token_id"]]), abs=1e-4)
        assert entry["token"] == engine.tokenizer.decode([entry["token_id"]], skip_special_tokens=False)
        top = entry["top_logprobs"]
        assert [t["token_id"] for t in top] == expected[i].topk(4).indices.tolist()
        assert [t["logprob"] for t in top] == pytest.approx(expected[i].topk(4).values.tolist(), abs=1e-4)
    if request_fields["temperature"] == 0.0:
        assert all(e["token_id"] == e["top_logprobs"][0]["token_id"] for e in out["logprobs"])


def test_streamed_logprobs_add_up_to_the_whole_results(engine):
    req = {"prompt": "The dog", "max_tokens": 10, "temperature": 0.8, "seed": 4, "logprobs": 2}
    whole = engine.generate(req)
    events = list(engine.generate_stream(req))
    streamed = [e for ev in events if ev["type"] == "delta" for e in ev["logprobs"]]
    # Equal up to f32 rounding: the second run reuses the first one's cached prompt prefix.
    assert [e["token_id"] for e in streamed] == [e["token_id"] for e in whole["logprobs"]] == whole["token_ids"]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole["logprobs"]], abs=1e-4)
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in streamed] == [
        [t["token_id"] for t in e["top_logprobs"]] for e in whole["logprobs"]]
    assert engine.generate({**req, "logprobs": None})["logprobs"] is None


class _FixedSet:
    """A token constraint that allows one fixed set of tokens and records what it is told."""

    def __init__(self, allowed: torch.Tensor, calls: list[str]):
        self._allowed, self._calls = allowed, calls
        self.finished = False

    def allowed_tokens(self) -> torch.Tensor:
        self._calls.append("mask")
        return self._allowed

    def accept(self, token_id: int) -> None:
        self._calls.append("accept")


def test_a_token_constraint_confines_every_sampled_token(engine):
    llm = engine.llm
    vocab = llm.runner.model.vocab_size
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:40]] = True
    calls: list[str] = []

    greedy = engine.parse({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
    seeded = engine.parse({"prompt": "The cat", "max_tokens": 16, "temperature": 1.0, "seed": 1, "ignore_eos": True,
                           "logprobs": 0})
    free = engine.parse({"prompt": "The cat", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
    seqs = [llm.add_request(r, engine.prompt_ids(r), r.max_tokens, constraint=c)
            for r, c in ((greedy, _FixedSet(allowed, calls)), (seeded, _FixedSet(allowed, calls)), (free, None))]
    logprobs = []
    while any(s.finish_reason is None for s in seqs):
        logprobs += [lp for out in llm.step() if out.seq is seqs[1] for lp in out.logprobs]
    for s in seqs[:2]:
        assert len(s.output_ids) == 16 and all(bool(allowed[t]) for t in s.output_ids), s.output_ids
    assert not all(bool(allowed[t]) for t in seqs[2].output_ids), "the unmasked row in the same batch is free"
    assert calls.count("mask") == calls.count("accept") == 32  # once per sampled token of each masked sequence
    # The reported logprobs stay the model's raw distribution, mask or not.
    expected = _raw_logprobs(engine, seqs[1].prompt_ids, seqs[1].output_ids)
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [max(float(expected[i, t]), LOGPROB_FLOOR) for i, t in enumerate(seqs[1].output_ids)], abs=1e-4)


def test_batch_invariant_mode_gives_a_seeded_request_the_same_tokens_and_logprobs_in_any_batch(tmp_path):
    engine = zllm.Engine.from_config(write_config(tmp_path, MODEL_DIR / "hf", runtime={"batch_invariant": True}))
    mine = {"prompt": "Lily and Ben", "max_tokens": 20, "temperature": 0.9, "top_p": 0.9, "seed": 21, "logprobs": 3}
    alone = engine.generate(mine)
    others = [{"prompt": "The sun was", "max_tokens": 25, "temperature": 1.1, "seed": 5, "logprobs": 5},
              {"prompt": "", "max_tokens": 9}, {"prompt": "Tom had a big", "max_tokens": 30, "presence_penalty": 1.0}]
    llm = engine.llm
    parsed = [engine.parse(r) for r in [*others[:2], mine, others[2]]]
    seqs = [llm.add_request(r, engine.prompt_ids(r), r.max_tokens) for r in parsed]
    logprobs = []
    while any(s.finish_reason is None for s in seqs):
        logprobs += [lp for out in llm.step() if out.seq is seqs[2] for lp in out.logprobs]
    assert seqs[2].output_ids == alone["token_ids"]
    assert [(lp.token_id, lp.logprob, [list(t) for t in lp.top]) for lp in logprobs] == [
        (e["token_id"], e["logprob"], [[t["token_id"], t["logprob"]] for t in e["top_logprobs"]])
        for e in alone["logprobs"]]
