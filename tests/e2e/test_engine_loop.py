"""The engine loop (``zllm.engine.loop``): one thread owns the runtime; threads and asyncio
tasks submit to it at once and get what they get alone; closing a stream or cancelling its
task aborts the request and frees its KV blocks, queued or running; a rejected request
leaves the loop serving; an engine failure ends every live request and every later call
with one clear error; ``close`` (or collecting the engine) ends the thread."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

import zllm
from tests.conftest import MODEL_DIR, write_config
from tests.step_gate import StepGate
from zllm.spec.errors import RequestError

PROMPTS = ["", "The cat", "Lily and Ben", "One day", "The sun was", "Tom had a big", "A little bird", "Sam"]


def _engine(tmp_path, **runtime):
    return zllm.Engine.from_config(write_config(tmp_path, MODEL_DIR / "hf", runtime=runtime))


def _greedy(i: int, prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 20 + 3 * i, "temperature": 0, "ignore_eos": True}


def _kv_idle(engine) -> bool:
    """Read on the loop thread, after every command sent before: no work, every block free."""
    return engine.loop.call(lambda llm: not llm.has_work()
                            and llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.num_blocks)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Batch-invariant, so a request's greedy tokens cannot depend on its batch-mates; no
    # prefix cache, so an idle engine has every KV block free.
    with _engine(tmp_path_factory.mktemp("loop"), batch_invariant=True, max_num_seqs=16,
                 prefix_cache_seqs=0) as eng:
        yield eng


def test_threads_and_asyncio_tasks_at_once_each_get_the_sequential_greedy_tokens(engine):
    reqs = [_greedy(i, p) for i, p in enumerate(PROMPTS * 2)]
    alone = [engine.generate(r)["token_ids"] for r in reqs]
    before = engine.llm.scheduler.stats.max_decodes_per_step
    results: list = [None] * len(reqs)
    start = threading.Barrier(len(PROMPTS) + 1)

    def in_thread(i: int) -> None:
        start.wait()
        results[i] = engine.generate(reqs[i])["token_ids"]

    async def in_task(i: int) -> list[int]:
        return [t async for e in engine.agenerate_stream(reqs[i]) for t in e.get("token_ids", [])]

    async def tasks() -> list[list[int]]:
        await asyncio.to_thread(start.wait)  # released with the threads
        return await asyncio.gather(*(in_task(i) for i in range(len(PROMPTS), len(reqs))))

    threads = [threading.Thread(target=in_thread, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    results[len(PROMPTS):] = asyncio.run(tasks())
    for t in threads:
        t.join(120)
    assert results == alone
    assert before == 1 and engine.llm.scheduler.stats.max_decodes_per_step >= 4  # they shared steps
    assert _kv_idle(engine)


def test_cancelling_the_consuming_task_aborts_the_request_and_frees_its_kv(engine):
    got: list[int] = []

    async def consume(two: asyncio.Event) -> None:
        async for event in engine.agenerate_stream({"prompt": "", "max_tokens": 400, "ignore_eos": True}):
            got.extend(event.get("token_ids", []))
            if len(got) >= 2:
                two.set()

    async def main() -> None:
        two = asyncio.Event()
        task = asyncio.create_task(consume(two))
        await two.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with StepGate(engine) as gate:  # the request is surely still running when it is cancelled
        gate_thread = threading.Thread(target=gate.steps, args=(2,))
        gate_thread.start()
        asyncio.run(main())
        gate_thread.join()
        assert _kv_idle(engine)  # the abort ran before this call, and no step since
    assert len(got) == 2 and engine.llm.scheduler.stats.expired_running == 0


def test_closing_a_queued_stream_removes_it_unprefilled(tmp_path):
    eng = _engine(tmp_path, max_num_seqs=1, prefix_cache_seqs=0)
    first = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = eng.generate(first)["token_ids"]
    st = eng.llm.scheduler.stats
    with StepGate(eng) as gate:
        a = eng.generate_stream(first)
        gate.steps(1)
        a_tokens = list(next(a)["token_ids"])
        prefilled = st.prefill_tokens
        b = eng.generate_stream({"prompt": "The little dog ran to the park", "max_tokens": 12})
        assert len(eng.llm.scheduler.waiting) == 1  # A holds the only slot
        b.close()  # returns once the loop dropped it
        assert not eng.llm.scheduler.waiting
    a_tokens += [t for e in a for t in e.get("token_ids", [])]
    assert a_tokens == alone and st.prefill_tokens == prefilled  # B never ran
    assert _kv_idle(eng)
    eng.close()


def test_a_rejected_request_leaves_the_loop_serving(engine):
    with pytest.raises(RequestError, match="token id 100000 is outside the vocabulary"):
        engine.generate({"prompt_token_ids": [1, 100000], "max_tokens": 4})

    async def rejected() -> None:
        with pytest.raises(RequestError, match="prompt_token_ids"):
            await engine.agenerate_stream({"prompt_token_ids": [1, -3], "max_tokens": 4}).__anext__()

    asyncio.run(rejected())
    assert engine.loop.alive
    assert engine.generate(_greedy(0, "The cat"))["usage"]["completion_tokens"] == 20


def test_an_engine_failure_ends_every_live_request_and_every_later_call(tmp_path):
    eng = _engine(tmp_path, prefix_cache_seqs=0)
    real_step, calls = eng.llm.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_step()

    eng.llm.step = failing_step
    streams = [eng.generate_stream({"prompt": p, "max_tokens": 50, "ignore_eos": True}) for p in ("The cat", "Sam")]
    for s in streams:
        with pytest.raises(zllm.EngineLoopError, match="the engine loop failed: RuntimeError: device lost") as info:
            list(s)
        assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(zllm.EngineLoopError, match="device lost"):
        eng.generate({"prompt": "One day", "max_tokens": 4})
    eng.loop._thread.join(60)
    assert not eng.loop.alive
    eng.close()  # a closed failed engine closes quietly


def test_close_ends_live_streams_and_joins_the_loop_thread(tmp_path):
    eng = _engine(tmp_path)
    with StepGate(eng) as gate:
        stream = eng.generate_stream({"prompt": "", "max_tokens": 300, "ignore_eos": True})
        gate.steps(1)
        assert next(stream)["token_ids"]
        eng.close()
    assert not eng.loop.alive
    with pytest.raises(zllm.EngineClosedError, match="the engine is closed"):
        next(stream)
    with pytest.raises(zllm.EngineClosedError):
        eng.generate({"prompt": "", "max_tokens": 4})
    eng.close()


def test_an_engine_collected_without_close_ends_its_loop_thread(tmp_path):
    eng = _engine(tmp_path)
    assert eng.generate({"prompt": "", "max_tokens": 4})["usage"]["completion_tokens"] == 4
    thread = eng.loop._thread
    del eng
    gc.collect()
    thread.join(60)
    assert not thread.is_alive()
