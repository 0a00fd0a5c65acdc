"""Malformed-input sweep: hypothesis-generated request bodies for every POST route.

Every answer is 2xx or 4xx, never 5xx; a 4xx is in the route's protocol error shape (OpenAI's
``{"error": {message, type, param, code}}``, Anthropic's ``{"type": "error", "error": {type,
message}}`` on ``/v1/messages``); a 200 — a weird body can still be valid — is a well-formed
answer that the official SDK's own types accept, streamed or not. The server is alive at the end.

Why hypothesis and not schemathesis against ``/openapi.json``: the bodies that break servers
are mostly *outside* the schema — non-JSON bytes, ``NaN``/``Infinity`` literals (Python's
``json`` accepts them), integers past int64, wrong ``Content-Type``s — and the interesting
in-schema ones are mutations of a *valid* request (one field made weird, one required field
dropped), which a hand-built strategy reaches in a few dozen examples where a schema-driven
generator spends most of its budget on bodies the first validation step rejects. The field
names come from the routes' own pydantic models, so the sweep follows the schema as it grows.

Bounded: :data:`EXAMPLES` bodies per route, ``max_tokens`` 2 in the valid base bodies; the
file runs in well under a minute against the session's chat server (stories260K with a chat
template, so chat routes can answer 200 too).
"""

from __future__ import annotations

import json
import math
from typing import Any

import anthropic.types
import httpx
import openai.types
import openai.types.chat
import openai.types.responses
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from zllm.server.anthropic_messages import Conversation, MessagesRequest
from zllm.server.openai_chat import ChatCompletionRequest
from zllm.server.openai_completions import CompletionRequest
from zllm.server.openai_responses import ResponsesRequest
from zllm.server.tokens import DetokenizeRequest, TokenizeRequest

EXAMPLES = 60

# ------------------------------------------------------------------ what is sent

HUGE_NUMBERS = [0, -1, -2, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 10**400,
                1e308, -1e308, 1e-320, 0.5, -0.0, 1.0000001,
                math.nan, math.inf, -math.inf]  # the last three are sent as NaN / Infinity literals
NAN_LIKE_STRINGS = ["NaN", "nan", "Infinity", "-Infinity", "inf", "1e999", "", " ", "null", "true", "0x10",
                    "\x00", "\ud800", "<|im_start|>", "</s>", "🙂" * 3]
UNKNOWN_FIELDS = ["frobnicate", "", "__proto__", "max_new_tokens", "prompt_token_ids", "messages[0]", "é"]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(HUGE_NUMBERS), st.sampled_from(NAN_LIKE_STRINGS),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml",
                 "application/json; charset=latin-1"]


def _valid_bases(model: str) -> dict[str, dict[str, Any]]:
    return {
        "/v1/completions": {"model": model, "prompt": "Once", "max_tokens": 2},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 2},
        "/v1/responses": {"model": model, "input": "Hi", "max_output_tokens": 2},
        "/v1/messages": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/messages/count_tokens": {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
        "/tokenize": {"model": model, "prompt": "Once"},
        "/detokenize": {"model": model, "tokens": [1, 2, 3]},
    }


SCHEMAS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
           "/v1/messages/count_tokens": Conversation, "/tokenize": TokenizeRequest,
           "/detokenize": DetokenizeRequest}
ROUTES = list(SCHEMAS)
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


@st.composite
def mutated_body(draw, base: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """A valid base body with 1–3 mutations: a known field set to a weird value, a field
    dropped, an unknown field added, or ``stream`` switched on."""
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["weird", "weird", "number", "drop", "unknown", "stream", "nested"]))
        if kind == "weird":
            body[draw(st.sampled_from(fields))] = draw(json_values)
        elif kind == "number":
            body[draw(st.sampled_from(fields))] = draw(st.sampled_from(HUGE_NUMBERS))
        elif kind == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif kind == "unknown":
            body[draw(st.sampled_from(UNKNOWN_FIELDS))] = draw(json_values)
        elif kind == "stream":
            body["stream"] = True
            if draw(st.booleans()):
                body["stream_options"] = {"include_usage": True}
        elif kind == "nested":  # garbage one level down, where the message/content models live
            # a list whose first item is an object (an earlier mutation may have left [None] or "x")
            key = next((k for k in ("messages", "input")
                        if isinstance(body.get(k), list) and body[k] and isinstance(body[k][0], dict)), None)
            if key is not None:
                item = dict(body[key][0])
                item[draw(st.sampled_from(["role", "content", "type", "name", "extra"]))] = draw(json_values)
                body[key] = [item]
    return body


@st.composite
def request(draw, route: str, model: str) -> tuple[bytes, str | None]:
    """(body bytes, Content-Type) for ``route``."""
    base = _valid_bases(model)[route]
    fields = sorted(SCHEMAS[route].model_fields)
    shape = draw(st.sampled_from(["mutated"] * 6 + ["any_json", "bytes", "content_type"]))
    content_type: str | None = "application/json"
    if shape == "any_json":
        data = json.dumps(draw(json_values)).encode()  # NaN/Infinity become bare literals
    elif shape == "bytes":
        data = draw(st.one_of(st.binary(max_size=64), st.sampled_from(
            [b"", b"{", b"}", b"{}", b'{"a":', b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"max_tokens": NaN}',
             b'{"prompt": "x", "prompt": 1}', b"[" * 5000 + b"]" * 5000, json.dumps(base).encode()[:-1]])))
    else:
        body = draw(mutated_body(base, fields)) if shape == "mutated" else base
        data = json.dumps(body).encode()
        if shape == "content_type":
            content_type = draw(st.sampled_from(CONTENT_TYPES))
    return data, content_type


# ------------------------------------------------------------------ what must come back


def _strict_json(text: str) -> Any:
    def refuse(const: str):
        raise AssertionError(f"non-JSON constant {const} in the answer")

    return json.loads(text, parse_constant=refuse)


def check_openai_error(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                         "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}


def check_anthropic_error(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"type", "message"}, err
    assert err["type"] in ANTHROPIC_ERROR_TYPES, err
    assert isinstance(err["message"], str) and err["message"], err


_COMPLETE = {
    "/v1/completions": openai.types.Completion,
    "/v1/chat/completions": openai.types.chat.ChatCompletion,
    "/v1/responses": openai.types.responses.Response,
    "/v1/messages": anthropic.types.Message,
}
_CHUNK = {
    "/v1/completions": TypeAdapter(openai.types.Completion),
    "/v1/chat/completions": TypeAdapter(openai.types.chat.ChatCompletionChunk),
    "/v1/responses": TypeAdapter(openai.types.responses.ResponseStreamEvent),
    "/v1/messages": TypeAdapter(anthropic.types.RawMessageStreamEvent),
}
_LAST_EVENT = {"/v1/responses": {"response.completed", "response.incomplete"}, "/v1/messages": {"message_stop"}}


def check_complete(route: str, body: Any) -> None:
    assert isinstance(body, dict), body
    if route == "/v1/messages/count_tokens":
        assert anthropic.types.MessageTokensCount.model_validate(body).input_tokens >= 1, body
        return
    if route == "/tokenize":
        assert set(body) >= {"count", "max_model_len", "tokens"} and body["count"] == len(body["tokens"]), body
        assert all(isinstance(t, int) and t >= 0 for t in body["tokens"]), body
        return
    if route == "/detokenize":
        assert set(body) == {"prompt"} and isinstance(body["prompt"], str), body
        return
    _COMPLETE[route].model_validate(body)
    if route == "/v1/messages":
        assert body["type"] == "message" and body["stop_reason"] in {"end_turn", "max_tokens", "stop_sequence"}
    elif route == "/v1/responses":
        assert body["object"] == "response" and body["status"] in {"completed", "incomplete"}
    else:
        assert body["choices"] and body["choices"][0]["finish_reason"] in {"stop", "length"}, body


def check_stream(route: str, text: str) -> None:
    payloads = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert payloads, text
    if route in _LAST_EVENT:
        events = [_strict_json(p) for p in payloads]
        for e in events:
            _CHUNK[route].validate_python(e)
        assert events[-1]["type"] in _LAST_EVENT[route], events[-1]
        if route == "/v1/responses":
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
        return
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [_strict_json(p) for p in payloads[:-1]]
    for c in chunks:
        assert "error" not in c, c
        if route == "/v1/completions":  # the SDK's Completion type wants a finish_reason on every choice
            assert c["object"] == "text_completion" and isinstance(c["id"], str), c
            for ch in c["choices"]:
                assert isinstance(ch["text"], str) and ch["finish_reason"] in {None, "stop", "length"}, c
        elif c["choices"]:
            _CHUNK[route].validate_python(c)
    assert any(ch.get("finish_reason") in {"stop", "length"} for c in chunks for ch in c["choices"]), chunks


def check_names_the_field(route: str, sent: Any, body: dict[str, Any]) -> None:
    """A 400 about a field names one the client sent, or (missing) one of the route's; an
    unknown-field error names exactly the key the client sent, never a renamed one."""
    if not isinstance(sent, dict):
        return
    message = body["error"]["message"]
    unknown = message.endswith("unknown field (see docs/server.md for the fields each route accepts)") \
        and " or " not in message  # one error, not a union's merged alternatives
    if route in ANTHROPIC_ROUTES:  # Anthropic's shape has no param; messages start with the field
        param = message.split(": ", 1)[0] if unknown else None
    else:
        param = body["error"]["param"]
    if not param or param in sent or param == '""' and "" in sent:
        return  # a top-level key named as sent
    root = param.split("[")[0].split(".")[0]
    if unknown and root == param:
        raise AssertionError(f"the unknown field is reported as {param!r}, not a key of {sorted(sent)}: {body}")
    assert root in sent or root in SCHEMAS[route].model_fields, body


def check_answer(route: str, r: httpx.Response, sent: Any = None) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, r.status_code
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        body = _strict_json(r.text)
        (check_anthropic_error if route in ANTHROPIC_ROUTES else check_openai_error)(body)
        if r.status_code == 400:
            check_names_the_field(route, sent, body)
    elif r.headers["content-type"].startswith("text/event-stream"):
        check_stream(route, r.text)
    else:
        check_complete(route, _strict_json(r.text))


# ------------------------------------------------------------------ the sweep


@pytest.fixture(scope="module")
def http(chat_server):
    with httpx.Client(base_url=chat_server.url, timeout=60) as client:
        yield client
    assert chat_server.healthy(), "the server stopped answering /health after the sweep"


@pytest.mark.parametrize("route", ROUTES)
def test_sweep(route: str, chat_server, http: httpx.Client) -> None:
    base = _valid_bases(chat_server.model)[route]
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=request(route, chat_server.model))
    # Always tried: the valid body, streamed and not (so a 200 is checked every run), and
    # non-finite numbers sent as the bare NaN/Infinity literals Python's json module accepts.
    @example(req=(json.dumps(base).encode(), "application/json"))
    @example(req=(json.dumps({**base, "stream": True}).encode(), "application/json"))
    @example(req=(json.dumps({**base, "temperature": math.nan, "top_p": math.inf}).encode(), "application/json"))
    @example(req=(json.dumps({**base, "max_tokens": 10**30, "seed": 2**64}).encode(), "application/json"))
    # A lone surrogate is a valid JSON escape but not Unicode text (it once reached the
    # tokenizer: 500); keys that look like pydantic's union tags, and names that are another
    # route's fields, are reported as themselves.
    @example(req=(json.dumps({**base, "prompt": "\ud800", "input": "\ud800", "system": "\ud800"}).encode(),
                  "application/json"))
    @example(req=(json.dumps({**base, "Temperature": 1}).encode(), "application/json"))
    @example(req=(json.dumps({**base, "str": 1}).encode(), "application/json"))
    @example(req=(json.dumps({**base, "": 1}).encode(), "application/json"))
    @example(req=(json.dumps({**base, "stop": "x", "max_tokens": "2", "prompt": 5}).encode(), "application/json"))
    def sweep(req: tuple[bytes, str | None]) -> None:
        data, content_type = req
        headers = {} if content_type is None else {"content-type": content_type}
        r = http.post(route, content=data, headers=headers)
        statuses.append(r.status_code)
        try:
            sent = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's json parses
            sent = None
        check_answer(route, r, sent)

    sweep()
    # The sweep saw both kinds of answer (a filter that rejected everything would check nothing).
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), statuses
    assert chat_server.healthy()


def test_server_answers_health_after_the_sweep(chat_server, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}).status_code == 200
