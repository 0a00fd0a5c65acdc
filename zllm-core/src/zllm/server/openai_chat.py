"""``POST /v1/chat/completions`` — OpenAI Chat Completions.

https://platform.openai.com/docs/api-reference/chat. Messages are passed to the engine as
its ``messages`` prompt form (``[{"role", "content"}]``); the model's chat template renders
them. Field table: docs/server.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request

from zllm.server.common import SamplingFields, StrictModel, new_id, openai_usage, reject_if, sse, sse_response, state
from zllm.server.errors import ApiError
from zllm.server.generation import EngineStream, run_to_end
from zllm.server.openai_completions import StreamOptions

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


RENAMES = {"prompt": "messages", "max_tokens": "max_completion_tokens"}


def message_text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def engine_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The engine's ``messages`` form; ``developer`` is the newer name of ``system``."""
    if not messages:
        raise ApiError(400, "messages: must hold at least one message", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function") or m.tool_calls or m.tool_call_id or m.function_call:
            raise ApiError(400, f"messages[{i}]: tool and function messages are not supported by zllm",
                           param=f"messages[{i}]", code="unsupported_parameter")
        if m.audio:
            raise ApiError(400, f"messages[{i}].audio: audio is not supported by zllm",
                           param=f"messages[{i}].audio", code="unsupported_parameter")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content)})
    return out


def engine_request(body: ChatCompletionRequest) -> dict[str, Any]:
    if body.n not in (None, 1):
        raise ApiError(400, "n: only n = 1 is supported", param="n", code="unsupported_parameter")
    for field in ("logprobs", "top_logprobs", "logit_bias", "tools", "functions", "response_format",
                  "reasoning_effort", "audio", "prediction", "web_search_options"):
        reject_if(getattr(body, field), field)
    if body.tool_choice not in (None, "none", "auto"):
        reject_if(body.tool_choice, "tool_choice")
    if body.modalities not in (None, ["text"]):
        reject_if(body.modalities, "modalities", "only [\"text\"]")
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        raise ApiError(400, "max_tokens: give only one of max_completion_tokens and max_tokens (its deprecated alias)",
                       param="max_tokens", code="invalid_value")
    req = body.engine_fields()
    req["messages"] = engine_messages(body.messages)
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
    stream = await EngineStream.open(st, request, engine_request(body), RENAMES)
    cid, created = new_id("chatcmpl-"), int(time.time())

    if not body.stream:
        text, final = await run_to_end(stream, request)
        return {"id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "finish_reason": final["finish_reason"], "logprobs": None}],
                "usage": openai_usage(final)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
               "choices": choices}
        if include_usage:
            out["usage"] = usage
        return out

    async def events():
        yield sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}]))
        async for event in stream.events():
            if event["type"] == "delta":
                if event["text"]:
                    yield sse(chunk([{"index": 0, "delta": {"content": event["text"]}, "finish_reason": None,
                                      "logprobs": None}]))
                continue
            yield sse(chunk([{"index": 0, "delta": {}, "finish_reason": event["finish_reason"], "logprobs": None}]))
            if include_usage:
                yield sse(chunk([], openai_usage(event)))
        yield sse("[DONE]")

    return sse_response(events(), stream)
