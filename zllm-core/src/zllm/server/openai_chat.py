"""``POST /v1/chat/completions`` — OpenAI Chat Completions.

https://platform.openai.com/docs/api-reference/chat. Messages are passed to the engine as
its ``messages`` prompt form (``[{"role", "content"}]``, with ``tool_calls`` and
``tool_call_id``); the model's chat template renders them and the request's ``tools``. The
engine's parsed answer becomes ``message.content``, ``reasoning_content`` and ``tool_calls``
(streamed as ``delta.tool_calls``). ``response_format`` (json_object, json_schema and zllm's
regex and grammar types) and a forced ``tool_choice`` reach the engine unchanged, which
enforces them by constrained decoding: a json_schema answer's ``content`` is the JSON text.
``n`` > 1 runs n engine requests at once (:func:`zllm.server.common.choice_requests`).
Field table: docs/server.md.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request

from zllm.server.common import (
    SamplingFields,
    StrictModel,
    choice_requests,
    new_id,
    openai_usage,
    reject_if,
    sse,
    sse_response,
    state,
)
from zllm.server.errors import ApiError
from zllm.server.generation import merged_events, open_streams, run_all_to_end
from zllm.server.logprobs import chat_logprobs
from zllm.server.openai_completions import StreamOptions, check_stream_options

router = APIRouter()


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted and ignored: chat templates do not render it
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # An assistant message echoed back with ``message.model_dump()`` carries these as null
    # (or []): accepted; a set ``function_call``/``audio`` is rejected like ``tool_calls``.
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None  # accepted and ignored


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated alias of max_completion_tokens
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    verbosity: str | None = None


RENAMES = {"prompt": "messages", "max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


def message_text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def engine_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The engine's ``messages`` form; ``developer`` is the newer name of ``system``.

    Raises:
        ApiError: 400 naming ``messages[i].content`` when it is missing, null or an empty
            list (allowed only for an assistant message with ``tool_calls``), or the field
            of a ``function`` message or ``audio``, which zllm does not support.
    """
    if not messages:
        raise ApiError(400, "messages: must hold at least one message", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if m.role == "function" or m.function_call:
            raise ApiError(400, f"messages[{i}]: function messages (the deprecated form of tools) are not supported "
                                "by zllm; use tools and tool messages", param=f"messages[{i}]",
                           code="unsupported_parameter")
        if m.audio:
            raise ApiError(400, f"messages[{i}].audio: audio is not supported by zllm",
                           param=f"messages[{i}].audio", code="unsupported_parameter")
        if (m.content is None or m.content == []) and not (m.role == "assistant" and m.tool_calls):
            state_ = "an empty list" if m.content == [] else "missing or null"
            raise ApiError(400, f"messages[{i}].content: is {state_}; every message but an assistant one with "
                                "tool_calls needs content (a string or text parts)",
                           param=f"messages[{i}].content", code="invalid_value")
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                "content": None if m.content is None else message_text(m.content)}
        if m.tool_calls:
            item["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None or m.role == "tool":
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def engine_request(body: ChatCompletionRequest) -> dict[str, Any]:
    check_stream_options(body.stream, body.stream_options)
    for field in ("logit_bias", "functions", "function_call", "reasoning_effort", "audio", "prediction",
                  "web_search_options"):
        reject_if(getattr(body, field), field)
    if body.modalities not in (None, ["text"]):
        reject_if(body.modalities, "modalities", "only [\"text\"]")
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        raise ApiError(400, "max_tokens: give only one of max_completion_tokens and max_tokens (its deprecated alias)",
                       param="max_tokens", code="invalid_value")
    req = body.engine_fields()
    req["messages"] = engine_messages(body.messages)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
    if body.logprobs:
        req["logprobs"] = 0 if body.top_logprobs is None else body.top_logprobs
    # The engine checks tools, tool_choice and response_format (names, known tool, schema) and
    # enforces them by constrained decoding; OpenAI's shapes are the engine's.
    for field in ("tools", "tool_choice", "parallel_tool_calls", "response_format"):
        if getattr(body, field) is not None:
            req[field] = getattr(body, field)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if limit is not None:
        req["max_tokens"] = limit
    if body.stop is not None:
        req["stop"] = body.stop
    return req


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    requests = choice_requests(engine_request(body), body.n, st.engine.config.generation.seed)
    streams = await open_streams(st, request, requests, RENAMES)
    cid, created = new_id("chatcmpl-"), int(time.time())

    if not body.stream:
        results = await run_all_to_end(streams, request)
        return {"id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
                "choices": [{"index": i, "message": assistant_message(final), "finish_reason": final["finish_reason"],
                             "logprobs": None if final["logprobs"] is None else chat_logprobs(final["logprobs"])}
                            for i, (_, final) in enumerate(results)],
                "usage": openai_usage([final for _, final in results])}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
               "choices": choices}
        if include_usage:
            out["usage"] = usage
        return out

    async def events():
        for i in range(len(streams)):
            yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}]))
        finals: list[dict[str, Any]] = [{} for _ in streams]
        async with aclosing(merged_events(streams)) as merged:
            async for i, event in merged:
                if event["type"] == "delta":
                    delta = stream_delta(event)
                    logprobs = None if not event["logprobs"] else chat_logprobs(event["logprobs"])
                    if delta or logprobs:
                        yield sse(chunk([{"index": i, "delta": delta, "finish_reason": None, "logprobs": logprobs}]))
                    continue
                finals[i] = event
                yield sse(chunk([{"index": i, "delta": {}, "finish_reason": event["finish_reason"],
                                  "logprobs": None}]))
        if include_usage:
            yield sse(chunk([], openai_usage(finals)))
        yield sse("[DONE]")

    return sse_response(events(), streams)


def assistant_message(final: dict[str, Any]) -> dict[str, Any]:
    """The response's ``message`` from the engine's final event (``content`` null when the
    answer is only tool calls, as OpenAI sends it)."""
    calls = final["tool_calls"]
    message: dict[str, Any] = {"role": "assistant", "content": final["content"] or (None if calls else ""),
                               "refusal": None}
    if final["reasoning_content"]:
        message["reasoning_content"] = final["reasoning_content"]  # vLLM's field for reasoning models
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return message


def stream_delta(event: dict[str, Any]) -> dict[str, Any]:
    """A chunk's ``delta`` from an engine delta event: the first piece of a tool call carries
    ``index``, ``id``, ``type`` and the name; later ones ``index`` and argument text."""
    delta: dict[str, Any] = {}
    if event["reasoning_content"]:
        delta["reasoning_content"] = event["reasoning_content"]
    if event["content"]:
        delta["content"] = event["content"]
    calls = []
    for c in event["tool_calls"]:
        if c["id"] is not None:
            calls.append({"index": c["index"], "id": c["id"], "type": "function",
                          "function": {"name": c["name"], "arguments": c["arguments"]}})
        elif c["arguments"]:
            calls.append({"index": c["index"], "function": {"arguments": c["arguments"]}})
    if calls:
        delta["tool_calls"] = calls
    return delta
