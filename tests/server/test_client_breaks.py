"""Regressions found by driving ``zllm serve`` as a client would, trying to break it.

Each test names the request that misbehaved and what a client got before the fix.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import chat_model_dir, needs_messages, start_server

MESSAGES = [{"role": "user", "content": "Hi"}]


def _openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _anthropic_error(r: httpx.Response) -> dict:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


# ------------------------------------------------------------------ HTTP-level shapes


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_405_on_post_routes_names_allowed_methods(server, method, path):
    # Was: 405 without the Allow header (RFC 9110 requires it), message "Method Not Allowed".
    r = httpx.request(method, server.url + path, timeout=10)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    err = _anthropic_error(r) if path == "/v1/messages" else _openai_error(r)
    assert method in err["message"] and path in err["message"]


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_head_on_read_only_routes(server, path):
    # Was: HEAD /health answered 405, so HEAD-probing uptime checks saw the server as down.
    r = httpx.head(server.url + path, timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(server.url + path, timeout=10).status_code == 200


def _chunks(total: int, piece: int = 256 * 1024):
    yield b'{"prompt": "'
    for _ in range(total // piece):
        yield b"a" * piece
    yield b'"}'


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_oversized_chunked_body_is_413_request_too_large(server, path):
    # Was: a chunked (no Content-Length) body over the limit got 413 with code null on OpenAI
    # routes, unlike the same body sent with a Content-Length.
    from zllm.server.app import MAX_BODY_BYTES

    r = httpx.post(server.url + path, content=_chunks(MAX_BODY_BYTES + 512 * 1024),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    if path == "/v1/messages":
        assert _anthropic_error(r)["type"] == "request_too_large"
    else:
        assert _openai_error(r)["code"] == "request_too_large"
    assert server.healthy()


def test_non_utf8_body_is_400_invalid_json(server):
    # Was: 400 "There was an error parsing the body" with code null (docs: invalid_json).
    r = httpx.post(server.url + "/v1/completions", content='{"prompt": "h\u00e9"}'.encode("latin-1"),
                   headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400
    assert _openai_error(r)["code"] == "invalid_json"


def test_unknown_path_under_messages_is_anthropic_shaped(server):
    # Was: POST /v1/messages/batches (an Anthropic route zllm does not serve) got a 404 in OpenAI's shape.
    r = httpx.post(server.url + "/v1/messages/batches",
                   json={"model": server.model, "messages": MESSAGES}, timeout=10)
    assert r.status_code == 404
    assert _anthropic_error(r)["type"] == "not_found_error"


# ------------------------------------------------------------------ SDK objects echoed back


@needs_messages
def test_chat_accepts_an_assistant_message_echoed_with_model_dump(chat_server):
    # Was: 400 "messages[1].annotations: unknown field" for the common
    # `messages.append(completion.choices[0].message.model_dump())`.
    client = openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_tokens=4)
    echoed = first.choices[0].message.model_dump()
    assert {"annotations", "audio", "function_call", "tool_calls"} <= set(echoed)
    second = client.chat.completions.create(
        model=chat_server.model, messages=[*MESSAGES, echoed, {"role": "user", "content": "More"}], max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length")
    # A set function_call / audio is still a 400 naming the message.
    for field, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a"})):
        r = httpx.post(f"{chat_server.url}/v1/chat/completions", timeout=10, json={
            "model": chat_server.model, "max_tokens": 4,
            "messages": [*MESSAGES, {"role": "assistant", "content": "x", field: value}]})
        assert r.status_code == 400 and _openai_error(r)["param"].startswith("messages[1]")


@needs_messages
def test_responses_accepts_output_items_echoed_with_model_dump(chat_server):
    # Was: 400 "input: ... unknown field" because the dumped output message carries `phase: null`.
    client = openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model=chat_server.model, input="Hi", max_output_tokens=4)
    items = [o.model_dump() for o in first.output]
    assert "phase" in items[0]
    second = client.responses.create(
        model=chat_server.model, max_output_tokens=4,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi", "prompt_cache_breakpoint": {}}]},
               *items, {"role": "user", "content": "More"}])
    assert second.status in ("completed", "incomplete")


# ------------------------------------------------------------------ KV pressure (engine)


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """The chat model with a 10-block (160-token) KV cache, so concurrent streams preempt."""
    tmp = tmp_path_factory.mktemp("serve-tight")
    srv = start_server(tmp, chat_model_dir(tmp / "stories-chat"),
                       runtime={"max_num_seqs": 4, "max_prefill_tokens": 32,
                                "kv_cache": {"num_blocks": 10, "block_size": 16}})
    yield srv
    srv.stop()


def test_identical_greedy_streams_under_kv_preemption_all_finish(tight_server):
    # 8 identical greedy streams of 120 tokens need ~8 x 9 blocks with 10 in the cache: the
    # newest are preempted and re-admitted after older identical ones finished and were
    # parked in the prefix cache (prompt + the same output). Before the fix some streams
    # ended with an `error` event "generation failed: AssertionError" instead of [DONE].
    body = {"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    def one(_):
        with httpx.stream("POST", tight_server.url + "/v1/completions", json=body, timeout=120) as r:
            return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    deadline = time.monotonic() + 10
    while tight_server.metrics()["zllm_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = tight_server.metrics()
    assert m["zllm_num_requests_running"] == 0 and m["zllm_num_requests_waiting"] == 0
    for status, data in results:
        assert status == 200 and data[-1] == "[DONE]", data[-2:]
        usage = json.loads(data[-2])["usage"]
        assert usage["completion_tokens"] == 120
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
