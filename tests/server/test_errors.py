"""Bad requests get 4xx in the protocol's own error shape, never 500, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import needs_messages


def post(server, path: str, body=None, *, content: bytes | None = None, headers=None) -> httpx.Response:
    if content is None:
        return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)
    return httpx.post(f"{server.url}{path}", content=content,
                      headers=headers or {"content-type": "application/json"}, timeout=30)


def openai_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
        assert param.split("[")[0].split(".")[0] in err["message"], err
    return err


def anthropic_error(r: httpx.Response, status: int = 400, kind: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    assert server.healthy()


COMPLETION = {"prompt": "Once", "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ({**COMPLETION, "max_tokens": -3}, "max_tokens"),
        ({**COMPLETION, "max_tokens": "4"}, "max_tokens"),
        ({**COMPLETION, "max_tokens": 4.5}, "max_tokens"),
        ({**COMPLETION, "temperature": -0.1}, "temperature"),
        ({**COMPLETION, "temperature": True}, "temperature"),
        ({**COMPLETION, "top_p": 0}, "top_p"),
        ({**COMPLETION, "top_p": 1.5}, "top_p"),
        ({**COMPLETION, "stop": 5}, "stop"),
        ({**COMPLETION, "seed": -1}, "seed"),
        ({"max_tokens": 4}, "prompt"),
        ({**COMPLETION, "prompt": None}, "prompt"),
        ({**COMPLETION, "prompt": []}, "prompt"),
        ({**COMPLETION, "prompt": [1, 100000]}, "prompt"),
        ({**COMPLETION, "prompt": ["a", "b"]}, "prompt"),
        ({**COMPLETION, "prompt": "Once upon a time " * 200}, "prompt"),  # > 512-token context
        ({**COMPLETION, "n": 0}, "n"),
        ({**COMPLETION, "n": 17}, "n"),
        ({**COMPLETION, "response_format": "json"}, "response_format"),
        ({**COMPLETION, "logprobs": 21}, "logprobs"),
        ({**COMPLETION, "logprobs": True}, "logprobs"),
        ({**COMPLETION, "stream": "yes"}, "stream"),
        ({**COMPLETION, "frobnicate": 1}, "frobnicate"),
    ],
)
def test_completions_bad_fields_name_the_field(server, body, param):
    openai_error(post(server, "/v1/completions", body), 400, param)


def test_unknown_model_is_404_model_not_found(server):
    err = openai_error(post(server, "/v1/completions", {**COMPLETION, "model": "gpt-9"}), 404, "model")
    assert err["code"] == "model_not_found" and server.model in err["message"]


@pytest.mark.parametrize("content", [b"{", b"", b"[1, 2]", b'"text"', b"null", b"\xff\xfe"])
def test_malformed_bodies_are_400_on_every_openai_route(server, content):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        openai_error(post(server, path, content=content), 400)


DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_INT = b'{"prompt": "Once", "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize(("content", "says"), [
    (DEEP, "nested too deeply"),
    (HUGE_INT, "integer literal of more than"),
    (b"{\"prompt\": \"\xc3\x28\"}", "not UTF-8 text"),  # a UTF-8 lead byte without its continuation
])
def test_unparsable_json_bodies_say_why_on_every_route(server, content, says):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        err = openai_error(post(server, path, content=content), 400)
        assert err["code"] == "invalid_json" and says in err["message"], err
    err = anthropic_error(post(server, "/v1/messages", content=content))
    assert says in err["message"], err


@pytest.mark.parametrize("content", [b"{", b"[]", b"null"])
def test_malformed_bodies_are_400_in_anthropic_shape(server, content):
    anthropic_error(post(server, "/v1/messages", content=content))


def test_oversized_body_is_413(server):
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    r = post(server, "/v1/completions", content=big)
    err = openai_error(r, 413)
    assert "larger than" in err["message"]
    anthropic_error(post(server, "/v1/messages", content=big), 413, "request_too_large")


def test_unknown_route_is_404_in_openai_shape(server):
    openai_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=10), 404)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 4}, "messages"),
        ({**CHAT, "messages": "hi"}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**CHAT, "messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, "messages[0].tool_call_id"),
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({**CHAT, "response_format": "json"}, "response_format"),
        ({**CHAT, "max_completion_tokens": 3}, "max_tokens"),  # both the field and its alias
        ({**CHAT, "model": "nope"}, "model"),
    ],
)
def test_chat_bad_fields_checked_before_generation(server, body, param):
    status = 404 if param == "model" else 400
    openai_error(post(server, "/v1/chat/completions", body), status, param)


@needs_messages
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "max_completion_tokens": 0, "max_tokens": None}, "max_completion_tokens"),
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "top_p": 2}, "top_p"),
    ],
)
def test_chat_bad_values_name_the_field(server, body, param):
    openai_error(post(server, "/v1/chat/completions", body), 400, param)


MESSAGES = {"model": "hf", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "body",
    [
        {k: v for k, v in MESSAGES.items() if k != "max_tokens"},  # max_tokens is required
        {k: v for k, v in MESSAGES.items() if k != "messages"},
        {**MESSAGES, "max_tokens": "4"},
        {**MESSAGES, "messages": [{"role": "system", "content": "x"}]},  # system is a top-level field
        {**MESSAGES, "messages": []},
        {**MESSAGES, "stop_sequences": "END"},
        {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}]},
        {**MESSAGES, "frobnicate": True},
    ],
)
def test_messages_bad_requests_are_400_in_anthropic_shape(server, body):
    anthropic_error(post(server, "/v1/messages", body))


def test_messages_unknown_model_is_404_not_found_error(server):
    anthropic_error(post(server, "/v1/messages", {**MESSAGES, "model": "claude-9"}), 404, "not_found_error")


@needs_messages
@pytest.mark.parametrize(
    "body",
    [{**MESSAGES, "max_tokens": 0}, {**MESSAGES, "temperature": -1}, {**MESSAGES, "top_p": 0},
     {**MESSAGES, "messages": [{"role": "user", "content": "Once upon a time " * 200}]}],
)
def test_messages_bad_values_are_400_in_anthropic_shape(server, body):
    anthropic_error(post(server, "/v1/messages", body))


def test_errors_are_counted_by_route_and_status(server):
    before = server.metrics().get('zllm_requests_total{route="/v1/completions",status="400"}', 0)
    post(server, "/v1/completions", {**COMPLETION, "max_tokens": 0})
    assert server.metrics()['zllm_requests_total{route="/v1/completions",status="400"}'] == before + 1
