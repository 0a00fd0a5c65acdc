"""server.request_timeout_s: a request is bounded from its arrival. One that runs out of time
is aborted and its KV blocks go back to the pool; one still queued for admission leaves the
queue unprefilled; the client gets a 408 with ``x-should-retry: false`` (or, once a stream
has started, a last error event in the protocol's shape), the official SDKs send it exactly
once, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import chat_model_dir, start_server

# A prompt no other request shares, so the prefix cache lends the request nothing and the
# free-block count must come back to exactly its idle value. The server runs a random-init
# model wide enough that a decode step takes milliseconds: its first token comes well within
# the timeout and its 480 tokens (random weights rarely pick EOS) take seconds, so every
# request here runs out of time, and a stream has started before it does.
LONG = {"prompt": "Zebra umbrella quietly", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Zebra umbrella quietly"}]
TIMEOUT_S = 0.3
QUEUED = 6


def slow_chat_model_dir(dst):
    """The stories260K tokenizer and chat template over a random-init llama of ~27M parameters
    (hidden 512, 8 layers), written by transformers: slow enough per token for deadlines."""
    import torch
    import transformers

    path = chat_model_dir(dst)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    # One running sequence at a time: concurrent requests wait in the admission queue.
    tmp = tmp_path_factory.mktemp("timeout")
    srv = start_server(tmp, slow_chat_model_dir(tmp / "slow-chat"),
                       server={"request_timeout_s": TIMEOUT_S, "served_model_name": "stories-chat"},
                       runtime={"prefix_cache_seqs": 0, "max_num_seqs": 1})
    yield srv
    srv.stop()


def _idle(srv) -> dict[str, float]:
    m = srv.metrics()
    assert m["zllm_num_requests_running"] == 0 and m["zllm_num_requests_waiting"] == 0
    return m


def _answered(m: dict[str, float], route: str, status: int) -> float:
    return m.get(f'zllm_requests_total{{route="{route}",status="{status}"}}', 0.0)


def test_non_streamed_request_past_its_timeout_gets_408_in_openai_shape(slow_server):
    idle = _idle(slow_server)
    r = httpx.post(f"{slow_server.url}/v1/completions", json={**LONG, "model": slow_server.model}, timeout=60)
    assert r.status_code == 408
    assert r.headers["x-should-retry"] == "false"
    err = r.json()["error"]
    assert err["code"] == "timeout" and "server.request_timeout_s" in err["message"]
    after = _idle(slow_server)
    assert after["zllm_kv_blocks_running"] == 0
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]
    assert slow_server.healthy()


def test_streamed_request_past_its_timeout_ends_with_an_error_event_and_frees_kv(slow_server):
    idle = _idle(slow_server)
    body = {**LONG, "model": slow_server.model, "stream": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(data[-1])
    assert last["error"]["code"] == "timeout"
    after = _idle(slow_server)
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]


def test_requests_queued_past_their_deadline_are_dropped_unprefilled_and_answered_408(slow_server):
    idle = _idle(slow_server)

    async def send_all():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(
                client.post(f"{slow_server.url}/v1/completions", json={**LONG, "model": slow_server.model})
                for _ in range(QUEUED)))

    answers = asyncio.run(send_all())
    assert [r.status_code for r in answers] == [408] * QUEUED
    assert all(r.headers["x-should-retry"] == "false" for r in answers)
    messages = [r.json()["error"]["message"] for r in answers]
    queued = [m for m in messages if "while queued for admission" in m]
    # One slot runs; the others wait behind it and all reach their deadline in the queue.
    assert queued, messages
    after = _idle(slow_server)
    expired = 'zllm_requests_expired_total{phase="waiting"}'
    assert after[expired] - idle[expired] == len(queued)
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]


def test_openai_sdk_sends_a_timed_out_request_exactly_once(slow_server):
    client = openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="unused", timeout=60)
    assert client.max_retries == 2  # the SDK's default, which retries a plain 408 twice
    before = slow_server.metrics()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=slow_server.model, prompt=LONG["prompt"], max_tokens=LONG["max_tokens"],
                                  temperature=0, extra_body={"ignore_eos": True})
    assert info.value.status_code == 408
    after = slow_server.metrics()
    assert _answered(after, "/v1/completions", 408) - _answered(before, "/v1/completions", 408) == 1


def test_anthropic_sdk_sends_a_timed_out_request_exactly_once(slow_server):
    client = anthropic.Anthropic(base_url=slow_server.url, api_key="unused", timeout=60)
    assert client.max_retries == 2
    before = slow_server.metrics()
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model=slow_server.model, max_tokens=LONG["max_tokens"], messages=CHAT)
    assert info.value.status_code == 408
    assert info.value.body["error"]["type"] == "timeout_error"
    after = slow_server.metrics()
    assert _answered(after, "/v1/messages", 408) - _answered(before, "/v1/messages", 408) == 1


def test_responses_stream_past_its_timeout_ends_with_the_protocols_error_event(slow_server):
    client = openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="unused", timeout=60)
    with client.responses.create(model=slow_server.model, input=CHAT[0]["content"],
                                 max_output_tokens=LONG["max_tokens"], stream=True,
                                 extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseErrorEvent)
    assert last.type == "error" and last.code == "timeout" and "server.request_timeout_s" in last.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert slow_server.healthy()


def test_responses_stream_error_event_on_the_wire(slow_server):
    body = {"model": slow_server.model, "input": CHAT[0]["content"], "max_output_tokens": 480, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/responses", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error"
    data = json.loads(lines[-1][len("data: "):])
    assert set(data) == {"type", "code", "message", "param", "sequence_number"}
    assert data["type"] == "error" and data["code"] == "timeout"
