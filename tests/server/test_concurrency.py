"""Many clients at once (one continuous batch) and clients that go away mid-stream."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import wait_until

PROMPTS = ["Once upon a time", "The cat", "Lily and Ben", "One day", "The sun was", "Tom had a big",
           "A little bird", "She went to the", "The dog ran", "Sam", "It was a sunny day", "Mom said",
           "The little boat", "Anna found a", "Ben and his", "The big tree"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def stream_text(client, model: str, prompt: str, max_tokens: int) -> str:
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    return "".join(c.choices[0].text for c in chunks)


def test_sixteen_concurrent_streams_each_equal_the_request_run_alone(client, server):
    # The server runs with runtime.batch_invariant (tests/server/conftest.py), so equality is exact
    # by construction, not by the luck of no near-ties.
    assert len(PROMPTS) == 16
    alone = [stream_text(client, server.model, p, 48) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: stream_text(client, server.model, p, 48), PROMPTS))
    assert together == alone
    assert len(set(alone)) == len(PROMPTS)  # distinct requests, so a mix-up would show


def test_concurrent_streams_share_decode_rounds(client, server):
    # While several streams run, the engine reports them running together: one batch.
    peak = 0
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_text, client, server.model, p, 96) for p in PROMPTS[:4]]
        while not all(f.done() for f in futures):
            peak = max(peak, server.metrics()["zllm_num_requests_running"])
            time.sleep(0.02)
        [f.result() for f in futures]
    assert peak >= 2


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/completions-nonstream"])
def test_client_disconnect_aborts_the_sequence_and_frees_its_kv_blocks(server, route):
    idle = server.metrics()
    assert idle["zllm_num_requests_running"] == 0 and idle["zllm_kv_blocks_running"] == 0
    # A prompt whose first token no finished request started with, so the prefix cache
    # lends it nothing and the free-block count must come back to exactly its idle value.
    body = {"model": server.model, "prompt": [300 + len(route), 42, 43], "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "stream": route == "/v1/completions"}
    with httpx.Client(timeout=30) as http:
        if body["stream"]:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(10):
                    next(lines)
                during = server.metrics()
        else:
            # A non-streamed request abandoned by its client (read timeout) is aborted too.
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
            during = None
    if during is not None:
        assert during["zllm_num_requests_running"] == 1 and during["zllm_kv_blocks_running"] >= 1
    assert wait_until(lambda: server.metrics()["zllm_num_requests_running"] == 0)
    after = server.metrics()
    assert after["zllm_kv_blocks_running"] == 0
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]
    # Far fewer tokens than the 480 asked for were generated: the sequence stopped early.
    generated = after["zllm_inter_token_latency_seconds_count"] - idle["zllm_inter_token_latency_seconds_count"] + 1
    assert 1 <= generated < 400
    assert server.healthy()
