"""Continuous batching and batch-invariant mode on the shipped model (stories260K).

With ``runtime.batch_invariant: true`` a request's tokens must not depend on its
batch-mates, so every comparison here is exact: each stream equals the same request run
alone — through mixed decode/prefill steps, chunked prompts, prefix reuse, queueing for KV
blocks and recompute preemption.
"""

from __future__ import annotations

import pytest

import zllm
from tests.concurrent_requests import run_together
from tests.conftest import MODEL_DIR, write_config
from tests.step_gate import StepGate
from zllm.spec.errors import KernelNotFound, RequestError

LONG_PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
               "big red ball. One day, she saw a small bird sitting on a tree. The bird was sad because it could not "
               "fly. Lily wanted to help the bird, so she asked her mom for help. Her mom said they could take the "
               "bird to a doctor. ")


def _engine(tmp_path, **runtime):
    return zllm.Engine.from_config(write_config(tmp_path, MODEL_DIR / "hf", runtime=runtime))


def _requests(engine) -> list[dict]:
    prompts = ["", "The cat", "Lily and Ben", "One day", "The sun was", "Tom had a big", "A little bird",
               "She went to the", "Once upon a time", "The dog ran", "Sam", "It was a sunny day", "Mom said",
               "The little boat", "Anna found a", LONG_PROMPT * 2]
    reqs = []
    for i, p in enumerate(prompts):
        r = {"prompt": p, "max_tokens": 24 + 3 * i, "ignore_eos": i % 5 == 0}
        if i % 2:
            r.update(temperature=0.6 + 0.1 * (i % 4), top_p=0.95, top_k=40, seed=100 + i)
        reqs.append(r)
    assert len(engine.tokenizer.encode(LONG_PROMPT * 2)) > 3 * engine.config.runtime.max_prefill_tokens
    return reqs


@pytest.fixture(scope="module")
def invariant_engine(tmp_path_factory):
    return _engine(tmp_path_factory.mktemp("inv"), batch_invariant=True, max_num_seqs=16, max_prefill_tokens=32,
                   max_batch_tokens=40)


def test_sixteen_simultaneous_streams_each_equal_the_request_run_alone(invariant_engine):
    eng = invariant_engine
    reqs = _requests(eng)
    alone = [eng.generate(r)["token_ids"] for r in reqs]
    before = eng.llm.scheduler.stats.max_decodes_per_step
    together = run_together(eng, reqs)
    assert together == alone
    assert len({tuple(a) for a in alone}) == len(reqs)  # distinct outputs, so a mix-up would show
    stats = eng.llm.scheduler.stats
    assert before == 1 and stats.max_decodes_per_step >= 8  # the streams really shared Decode Rounds
    assert stats.mixed_steps > 0


def test_a_long_prompt_is_prefilled_in_chunks_interleaved_with_running_decodes(tmp_path):
    eng = _engine(tmp_path, batch_invariant=True, max_prefill_tokens=16, max_batch_tokens=20, prefix_cache_seqs=0)
    st = eng.llm.scheduler.stats
    with StepGate(eng) as gate:  # the long prompt arrives while both short streams decode
        short = [eng.generate_stream({"prompt": p, "max_tokens": 60, "ignore_eos": True})
                 for p in ("The cat", "One day")]
        gate.steps(2)  # one prefill each
        got = [next(s)["token_ids"] for s in short]
        mixed_before, steps_before = st.mixed_steps, st.steps
        long_req = {"prompt": LONG_PROMPT, "max_tokens": 5}
        n_prompt = len(eng.tokenizer.encode(LONG_PROMPT)) + 1
        long_stream = eng.generate_stream(long_req)
    long_tokens = []
    for event in long_stream:  # its steps also advance the two short streams
        long_tokens += event.get("token_ids", [])
    chunks = -(-n_prompt // (20 - 2))  # 2 decodes leave 18 of the 20-token budget for the chunk
    assert st.mixed_steps - mixed_before >= chunks - 1
    # the short streams gained a token in every one of those steps: not stalled by the prompt
    assert st.steps - steps_before >= chunks and st.max_decodes_per_step >= 2
    for i, s in enumerate(short):
        for event in s:
            got[i] += event.get("token_ids", [])
    solo = _engine(tmp_path, batch_invariant=True, prefix_cache_seqs=0)
    assert long_tokens == solo.generate(long_req)["token_ids"]
    assert got == [solo.generate({"prompt": p, "max_tokens": 60, "ignore_eos": True})["token_ids"]
                   for p in ("The cat", "One day")]


def test_requests_beyond_the_kv_pool_queue_and_all_complete_as_alone(tmp_path):
    # 8 blocks x 16 tokens: each request holds ~4-5 blocks at its end, so at most two run
    # at once; the rest wait for blocks (and a growing one may be preempted and recomputed).
    eng = _engine(tmp_path, batch_invariant=True, kv_cache={"num_blocks": 8, "block_size": 16}, prefix_cache_seqs=0,
                  max_num_seqs=8)
    reqs = [{"prompt": p, "max_tokens": 50, "ignore_eos": True, **({"temperature": 0.8, "seed": i} if i % 2 else {})}
            for i, p in enumerate(["The cat", "One day", "Lily", "Tom had a big", "The sun", "A bird"])]
    alone = [eng.generate(r)["token_ids"] for r in reqs]
    together = run_together(eng, reqs)
    assert together == alone and all(len(t) == 50 for t in together)
    st = eng.llm.scheduler.stats
    assert st.admission_waits > 0
    assert eng.llm.scheduler.kv.num_free_blocks == 8 and not eng.llm.has_work()


def test_a_prompt_larger_than_the_whole_kv_pool_is_rejected_at_submit(tmp_path):
    eng = _engine(tmp_path, kv_cache={"num_blocks": 4, "block_size": 16})
    with pytest.raises(RequestError, match=r"\(70 tokens\) needs 5 KV cache blocks .* has 4 blocks \(64 tokens"):
        eng.generate_stream({"prompt_token_ids": [1] * 70, "max_tokens": 4})
    assert not eng.llm.has_work()
    # a prompt that fits runs, and stops with "length" when it fills the pool
    out = eng.generate({"prompt_token_ids": [1] * 60, "max_tokens": 30, "ignore_eos": True})
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4


def test_batch_invariant_mode_without_an_invariant_kernel_names_op_and_backend(tmp_path):
    # The f32 references are not declared batch-invariant: forcing one in this mode must fail,
    # not silently bind a batch-dependent kernel.
    cfg = write_config(tmp_path, MODEL_DIR / "hf", runtime={"batch_invariant": True},
                       backend={"force_reference": ["linear"]})
    with pytest.raises(KernelNotFound, match="no batch-invariant kernel 'linear' for backend 'reference'"):
        zllm.Engine.from_config(cfg)
