"""Request deadlines in the runtime (``Engine.submit(..., deadline=)``, ``Engine.drain``): a
request whose deadline passed is dropped by the scheduler within one step — from the queue,
never prefilled, if it was still waiting for admission; aborted with its KV blocks freed if
it was running — and its stream raises DeadlineExceeded. Deadlines already in the past make
every case deterministic (no wall-clock waits), and a StepGate paces the engine loop so a
request is queued or running exactly when the test says."""

from __future__ import annotations

import time

import pytest

import zllm
from tests.conftest import MODEL_DIR, write_config
from tests.step_gate import StepGate
from zllm.spec.errors import DeadlineExceeded

A = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
B = {"prompt": "The little dog ran to the park", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # One running sequence at a time, so a second request waits in the queue; no prefix cache,
    # so the free-block count returns exactly to the pool's size.
    cfg = write_config(tmp_path_factory.mktemp("deadline"), MODEL_DIR / "hf",
                       runtime={"max_num_seqs": 1, "prefix_cache_seqs": 0})
    return zllm.Engine.from_config(cfg)


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.get("token_ids", [])]


def test_a_queued_request_past_its_deadline_leaves_the_queue_unprefilled(engine):
    sched = engine.llm.scheduler
    alone = engine.generate(A)["token_ids"]
    before = (sched.stats.prefill_tokens, sched.stats.expired_waiting)
    with StepGate(engine) as gate:
        a = engine.generate_stream(A)
        gate.steps(1)
        first = [next(a)]  # A is admitted and prefilled; it holds the only running slot
        b = engine.generate_stream(B, deadline=time.monotonic() - 1.0)
        assert [s.request.prompt for s in sched.waiting] == [B["prompt"]]
        gate.steps(1)
        first.append(next(a))  # that step dropped B before scheduling anything
        assert not sched.waiting
        with pytest.raises(DeadlineExceeded, match="while queued for admission") as info:
            next(b)
    assert info.value.queued and info.value.output_tokens == 0
    assert sched.stats.expired_waiting == before[1] + 1
    a_prompt = len(engine.tokenizer.encode(A["prompt"], add_special_tokens=engine.tokenizer.add_bos))
    assert sched.stats.prefill_tokens == before[0] + a_prompt  # B's prompt never ran
    assert _tokens(first + list(a)) == alone  # A is untouched by B's removal
    assert engine.llm.scheduler.kv.num_free_blocks == engine.llm.scheduler.kv.num_blocks


def test_drain_ends_a_running_request_and_frees_its_kv_blocks(engine):
    kv = engine.llm.scheduler.kv
    sched = engine.llm.scheduler
    with StepGate(engine) as gate:
        a = engine.generate_stream({**A, "max_tokens": 64})
        gate.steps(3)
        got = _tokens([next(a), next(a), next(a)])
        assert kv.num_free_blocks < kv.num_blocks
        running_before = sched.stats.expired_running
        engine.drain(time.monotonic())
        try:
            gate.steps(1)
            with pytest.raises(DeadlineExceeded, match=f"after generating {len(got)} tokens") as info:
                list(a)
        finally:
            sched.drain_deadline = None  # the module's engine serves the other tests
    assert not info.value.queued
    assert sched.stats.expired_running == running_before + 1
    assert not sched.running and kv.num_free_blocks == kv.num_blocks


def test_a_request_before_its_deadline_runs_to_the_end(engine):
    out = engine.generate(A, deadline=time.monotonic() + 3600)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == A["max_tokens"]
