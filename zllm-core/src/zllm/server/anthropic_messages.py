"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` — Anthropic Messages.

https://docs.anthropic.com/en/api/messages and .../messages-streaming. ``system`` (a string
or text blocks) becomes a leading system message of the engine's ``messages`` prompt form;
``tool_use`` blocks become the assistant's ``tool_calls`` and ``tool_result`` blocks ``tool``
messages; ``tools`` (client tools with an ``input_schema``) reach the chat template. The
engine's parsed answer becomes ``thinking``, ``text`` and ``tool_use`` blocks (streamed with
``thinking_delta``, ``text_delta`` and ``input_json_delta``). ``output_config.format`` becomes
the engine's json_schema ``response_format``; ``tool_choice`` ``any`` / ``tool`` its
``required`` / named function, enforced by constrained decoding. ``count_tokens`` renders the
same prompt and counts it. Errors use Anthropic's shape (see :mod:`zllm.server.errors`).
Field table: docs/server.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request

from zllm.server.common import StrictModel, new_id, reject_if, sse, sse_response, state
from zllm.server.errors import ApiError
from zllm.server.generation import EngineStream, run_to_end
from zllm.server.tokens import prompt_ids
from zllm.spec.request import TOOL_NAME_PATTERN

router = APIRouter()


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted and ignored (prompt caching hint)
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None  # accepted: the template sees the result text either way
    cache_control: dict[str, Any] | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(StrictModel):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools (web_search_…) are rejected
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class OutputConfig(StrictModel):
    effort: str | None = None  # accepted and ignored: zllm models do not think
    format: dict[str, Any] | None = None  # structured output: checked by engine_format


class Conversation(StrictModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt and what
    shapes the answer."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
    speed: str | None = None
    cache_control: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Rejected with a 400 naming the field.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None


class MessagesRequest(Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    # Sampling: in the Messages API before 2026 (current SDKs send them via extra_body).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
    metadata: Metadata | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    # Rejected with a 400 naming the field.
    container: str | None = None


RENAMES = {"prompt": "messages", "stop": "stop_sequences",
           "response_format": "output_config.format", "response_format.json_schema": "output_config.format",
           "tool_choice.function": "tool_choice", "tools[*].function.parameters": "tools[*].input_schema",
           "tools[*].function": "tools[*]"}

FORMAT_NAME = "output"
"""The name the engine's json_schema ``response_format`` gets (Anthropic's format has none)."""


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content if isinstance(b, TextBlock))


def engine_messages(body: Conversation) -> list[dict[str, Any]]:
    """The engine's ``messages``: ``tool_use`` blocks → the assistant's ``tool_calls``; each
    ``tool_result`` block → a ``tool`` message, ahead of the user's text.

    Raises:
        ApiError: 400 naming ``messages[i].content`` for an empty list, or a block in the
            wrong role's message.
    """
    if not body.messages:
        raise ApiError(400, "messages: must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system)})
    open_calls: set[str] = set()
    for i, m in enumerate(body.messages):
        if m.content == []:
            raise ApiError(400, f"messages[{i}].content: is an empty list; send text or content blocks",
                           param=f"messages[{i}].content")
        blocks = [] if isinstance(m.content, str) else m.content
        for j, b in enumerate(blocks):
            wrong = (m.role == "user" and isinstance(b, ToolUseBlock)) or \
                (m.role == "assistant" and isinstance(b, ToolResultBlock))
            if wrong:
                raise ApiError(400, f"messages[{i}].content[{j}]: a {b.type} block cannot be in a {m.role} message",
                               param=f"messages[{i}].content[{j}]")
        for j, b in enumerate(blocks):
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in open_calls:
                    raise ApiError(400, f"messages[{i}].content[{j}].tool_use_id: {b.tool_use_id!r} answers no "
                                        "tool_use block of the assistant message before it",
                                   param=f"messages[{i}].content[{j}].tool_use_id")
                open_calls.discard(b.tool_use_id)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": "" if b.content is None else _text(b.content)})
        text = _text(m.content)
        calls: list[dict[str, Any]] = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in blocks if isinstance(b, ToolUseBlock)
        ]
        if m.role == "assistant":
            open_calls = {c["id"] for c in calls}
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": m.role, "content": text})
    return out


def engine_tools(body: Conversation) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in the engine's terms."""
    req: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise ApiError(400, f"tools[{i}].type: server tools ({t.type!r}) are not supported by zllm; "
                                    "give client tools (name, description, input_schema)",
                               param=f"tools[{i}].type", code="unsupported_parameter")
            if not TOOL_NAME_PATTERN.fullmatch(t.name):
                raise ApiError(400, f"tools[{i}].name: expected 1 to 64 letters, digits, '_' or '-' "
                                    f"(^[a-zA-Z0-9_-]{{1,64}}$), got {t.name!r}", param=f"tools[{i}].name")
            fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
            if t.description is not None:
                fn["description"] = t.description
            tools.append({"type": "function", "function": fn})
        req["tools"] = tools
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise ApiError(400, "tool_choice.name: required when tool_choice.type is 'tool'",
                               param="tool_choice.name")
            req["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            req["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}[choice.type]
        if choice.disable_parallel_tool_use:
            req["parallel_tool_calls"] = False
    return req


def engine_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``) as the engine's
    ``response_format``, named :data:`FORMAT_NAME`.

    Raises:
        ApiError: 400 naming ``output_config.format.type`` for another type, or a key it does not take.
    """
    if fmt.get("type") != "json_schema":
        raise ApiError(400, f"output_config.format.type: expected 'json_schema', got {fmt.get('type')!r}",
                       param="output_config.format.type")
    for key in fmt:
        if key not in ("type", "schema"):
            raise ApiError(400, f"output_config.format.{key}: unknown field (a json_schema format takes type "
                                "and schema)", param=f"output_config.format.{key}")
    return {"type": "json_schema", "json_schema": {"name": FORMAT_NAME, "schema": fmt.get("schema")}}


def conversation_request(body: Conversation) -> dict[str, Any]:
    """The engine request fields of the conversation: ``messages``, tools and ``response_format``.

    Raises:
        ApiError: 400 naming the field (see :func:`engine_messages`, :func:`engine_tools`,
            :func:`engine_format`), or ``thinking`` / ``mcp_servers``, which zllm does not do.
    """
    reject_if(body.mcp_servers, "mcp_servers")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        reject_if(body.thinking, "thinking")
    req: dict[str, Any] = {"messages": engine_messages(body), **engine_tools(body)}
    if body.output_config is not None and body.output_config.format is not None:
        req["response_format"] = engine_format(body.output_config.format)
    return req


def engine_request(body: MessagesRequest) -> dict[str, Any]:
    reject_if(body.container, "container")
    req = {**conversation_request(body), "max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            req[name] = getattr(body, name)
    if body.stop_sequences is not None:
        req["stop"] = body.stop_sequences
    return req


def content_blocks(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The response's content: a ``thinking`` block for reasoning, a ``text`` block (always,
    unless the answer is only tool calls), a ``tool_use`` block per call."""
    blocks: list[dict[str, Any]] = []
    if final["reasoning_content"]:
        blocks.append({"type": "thinking", "thinking": final["reasoning_content"], "signature": ""})
    if final["content"] or not final["tool_calls"]:
        blocks.append({"type": "text", "text": final["content"]})
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": _input(c["arguments"])}
               for c in final["tool_calls"]]
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    # A call cut short by max_tokens has incomplete JSON; Anthropic's input must be an object.
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(final: dict[str, Any]) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` from the engine's final event: the stop string
    the engine cut the text at, never one re-found in the decoded tokens."""
    reason = final["finish_reason"]
    if reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reason == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    matched = final["stop_sequence"]
    return {"stop_reason": "end_turn" if matched is None else "stop_sequence", "stop_sequence": matched}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    stream = await EngineStream.open(st, request, engine_request(body), RENAMES)
    mid = new_id("msg_")

    if not body.stream:
        _, final = await run_to_end(stream, request)
        u = final["usage"]
        return {"id": mid, "type": "message", "role": "assistant", "model": body.model,
                "content": content_blocks(final), **_stop(final),
                "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                          "cache_read_input_tokens": u["cached_tokens"], "cache_creation_input_tokens": 0}}

    async def events():
        start = {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": 0, "output_tokens": 0}}
        first = True
        blocks = _BlockStream()
        async for event in stream.events():
            if first:
                # The prompt length is known once the request is queued; the first event
                # arrives after its prefill. Anthropic reports input tokens in message_start.
                first = False
                start["usage"]["input_tokens"] = stream.prompt_tokens
                yield sse({"type": "message_start", "message": start}, "message_start")
            if event["type"] == "delta":
                for out in blocks.delta(event):
                    yield out
                continue
            u = event["usage"]
            for out in blocks.close(last=True):
                yield out
            yield sse({"type": "message_delta", "delta": _stop(event),
                       "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")

    return sse_response(events(), [stream], anthropic=True)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: Conversation, request: Request):
    """The prompt's length in tokens: exactly what ``/v1/messages`` would feed the model (the
    chat template's rendering with the tools), ``{"input_tokens": N}``."""
    st = state(request)
    st.check_model(body.model)
    ids = await prompt_ids(st, conversation_request(body), RENAMES)
    return {"input_tokens": len(ids)}


class _BlockStream:
    """Content-block events of a streamed answer: a block opens when its kind of text first
    arrives (thinking, text, each tool_use) and closes when another kind starts."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(sse({"type": "content_block_start", "index": self.index, "content_block": block},
                       "content_block_start"))
        return out

    def close(self, last: bool = False) -> list[str]:
        out = []
        if last and self.index < 0:  # an empty answer still has its (empty) text block
            out += self._open("text", {"type": "text", "text": ""})
        if self.kind is not None:
            out.append(sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
            self.kind = None
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def delta(self, event: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if event["reasoning_content"]:
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": event["reasoning_content"]}))
        if event["content"]:
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": event["content"]}))
        for c in event["tool_calls"]:
            if c["id"] is not None:
                out += self._open("tool_use", {"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}})
            if c["arguments"]:
                out.append(self._delta({"type": "input_json_delta", "partial_json": c["arguments"]}))
        return out
