"""``POST /v1/messages`` — Anthropic Messages.

https://docs.anthropic.com/en/api/messages and .../messages-streaming. ``system`` (a string
or text blocks) becomes a leading system message of the engine's ``messages`` prompt form.
Errors use Anthropic's shape (see :mod:`zllm.server.errors`). Field table: docs/server.md.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request

from zllm.server.common import StrictModel, new_id, reject_if, sse, sse_response, state, stop_sequence_matched
from zllm.server.errors import ApiError
from zllm.server.generation import EngineStream, run_to_end

router = APIRouter()


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted and ignored (prompt caching hint)
    citations: list[dict[str, Any]] | None = None


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class Metadata(StrictModel):
    user_id: str | None = None


class OutputConfig(StrictModel):
    effort: str | None = None  # accepted and ignored: zllm models do not think
    format: dict[str, Any] | None = None  # structured output: rejected


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    # Sampling: in the Messages API before 2026 (current SDKs send them via extra_body).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
    metadata: Metadata | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Rejected with a 400 naming the field.
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    container: str | None = None
    mcp_servers: list[dict[str, Any]] | None = None


RENAMES = {"prompt": "messages", "stop": "stop_sequences"}


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def engine_request(body: MessagesRequest) -> dict[str, Any]:
    for field in ("tools", "tool_choice", "container", "mcp_servers"):
        reject_if(getattr(body, field), field)
    if body.output_config is not None:
        reject_if(body.output_config.format, "output_config.format")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        reject_if(body.thinking, "thinking")
    if not body.messages:
        raise ApiError(400, "messages: must hold at least one message", param="messages")
    messages = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    messages += [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    req: dict[str, Any] = {"messages": messages, "max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            req[name] = getattr(body, name)
    if body.stop_sequences is not None:
        req["stop"] = body.stop_sequences
    return req


def _stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    stream = await EngineStream.open(st, request, engine_request(body), RENAMES)
    mid = new_id("msg_")
    stops = body.stop_sequences or []

    if not body.stream:
        text, final = await run_to_end(stream, request)
        matched = stop_sequence_matched(st.engine, stops, text, stream.token_ids) \
            if final["finish_reason"] == "stop" else None
        u = final["usage"]
        return {"id": mid, "type": "message", "role": "assistant", "model": body.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": _stop_reason(final["finish_reason"], matched), "stop_sequence": matched,
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                          "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0}}

    async def events():
        parts: list[str] = []
        start = {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": 0, "output_tokens": 0}}
        first = True
        async for event in stream.events():
            if first:
                # The prompt length is known once the request is queued; the first event
                # arrives after its prefill. Anthropic reports input tokens in message_start.
                first = False
                start["usage"]["input_tokens"] = stream.prompt_tokens
                yield sse({"type": "message_start", "message": start}, "message_start")
                yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                          "content_block_start")
            if event["type"] == "delta":
                if event["text"]:
                    parts.append(event["text"])
                    yield sse({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": event["text"]}}, "content_block_delta")
                continue
            text = "".join(parts)
            matched = stop_sequence_matched(st.engine, stops, text, stream.token_ids) \
                if event["finish_reason"] == "stop" else None
            u = event["usage"]
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": _stop_reason(event["finish_reason"], matched), "stop_sequence": matched},
                       "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")

    return sse_response(events(), stream, anthropic=True)
