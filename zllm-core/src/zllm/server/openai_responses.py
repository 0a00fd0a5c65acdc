"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` — OpenAI Responses.

https://platform.openai.com/docs/api-reference/responses. ``input`` (a string or message
items) and ``instructions`` (a leading system message) become the engine's ``messages``
prompt form. Responses are kept in a bounded in-memory store (the newest
:data:`STORE_CAPACITY`, unless ``store: false``) so ``previous_response_id`` can continue a
conversation and ``GET /v1/responses/{id}`` can fetch one; a restart forgets them.
Field table: docs/server.md.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request

from zllm.server.common import SamplingFields, StrictModel, new_id, reject_if, sse, sse_response, state
from zllm.server.errors import ERROR_TYPES, ApiError
from zllm.server.generation import EngineStream, run_to_end

router = APIRouter()

# An error event's code when the error carries none (the error object's type, by status).
_ERROR_TYPES = {status: openai_type for status, (openai_type, _) in ERROR_TYPES.items()}

STORE_CAPACITY = 1024
"""Responses kept for ``previous_response_id`` and retrieval; the oldest go first."""


class InputText(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # accepted and ignored (output_text echoed back)
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # accepted and ignored (a caching hint)


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None  # accepted and ignored (an output item echoed back)
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # accepted and ignored (``model_dump()`` sends null)


class TextFormat(StrictModel):
    type: str


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted and ignored: zllm adds no padding


class ResponsesRequest(SamplingFields):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    stop: str | list[str] | None = None  # zllm extension (Responses has no stop field)
    # Rejected with a 400 naming the field (they change generation; zllm does not do them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


RENAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens"}


class ResponseStore:
    """The newest responses and the conversations behind them (thread-safe, bounded)."""

    def __init__(self, capacity: int = STORE_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise ApiError(404 if param == "response_id" else 400,
                           f"{param}: no stored response with id {response_id!r} (zllm keeps the newest "
                           f"{self.capacity} in memory, only those created with store not false)",
                           param=param, code="response_not_found")
        return item


def _store(request: Request) -> ResponseStore:
    return state(request).responses


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(body: ResponsesRequest, history: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation this request continues (no instructions): history, then ``input``."""
    if isinstance(body.input, str):
        items = [{"role": "user", "content": body.input}]
    else:
        if not body.input:
            raise ApiError(400, "input: must hold at least one message item", param="input", code="invalid_value")
        items = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                 for m in body.input]
    return history + items


def engine_request(body: ResponsesRequest, convo: list[dict[str, str]]) -> dict[str, Any]:
    for field in ("tools", "reasoning", "include", "top_logprobs", "background", "conversation", "prompt"):
        reject_if(getattr(body, field), field)
    if body.tool_choice not in (None, "none", "auto"):
        reject_if(body.tool_choice, "tool_choice")
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise ApiError(400, f"text.format: only type 'text' is supported, got {body.text.format.type!r}",
                       param="text.format", code="unsupported_parameter")
    req = body.engine_fields()
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    req["messages"] = system + convo
    if body.max_output_tokens is not None:
        req["max_tokens"] = body.max_output_tokens
    if body.stop is not None:
        req["stop"] = body.stop
    return req


def _usage(final: dict[str, Any] | None) -> dict[str, Any] | None:
    if final is None:
        return None
    u = final["usage"]
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    store = _store(request)
    history = store.get(body.previous_response_id, "previous_response_id")[1] \
        if body.previous_response_id is not None else []
    convo = conversation(body, history)
    stream = await EngineStream.open(st, request, engine_request(body, convo), RENAMES)
    rid, mid, created = new_id("resp_"), new_id("msg_"), int(time.time())

    def message(text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": mid, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_part(text)]}

    def response(status: str, output: list[dict[str, Any]], final: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = final is not None and final["finish_reason"] == "length"
        return {
            "id": rid, "object": "response", "created_at": created, "model": st.model_name,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "text": {"format": {"type": "text"}}, "metadata": body.metadata or {}, "usage": _usage(final),
        }

    def finished(text: str, final: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if final["finish_reason"] == "length" else "completed"
        out = response(status, [message(text, status)], final)
        if body.store is not False:
            store.put(out, convo + [{"role": "assistant", "content": text}])
        return out

    if not body.stream:
        text, final = await run_to_end(stream, request)
        return finished(text, final)

    seq = iter(range(1 << 62))

    def ev(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    def error_event(err: ApiError) -> str:
        # ResponseErrorEvent: numbered like every other event of the stream.
        return ev("error", code=err.code or _ERROR_TYPES.get(err.status, "server_error"), message=err.message,
                  param=err.param)

    async def events():
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        yield ev("response.created", response=response("in_progress", [], None))
        yield ev("response.in_progress", response=response("in_progress", [], None))
        yield ev("response.output_item.added", output_index=0, item=message("", "in_progress"))
        yield ev("response.content_part.added", **where, part=_part(""))
        parts: list[str] = []
        async for event in stream.events():
            if event["type"] == "delta":
                if event["text"]:
                    parts.append(event["text"])
                    yield ev("response.output_text.delta", **where, delta=event["text"], logprobs=[])
                continue
            text = "".join(parts)
            done = finished(text, event)
            yield ev("response.output_text.done", **where, text=text, logprobs=[])
            yield ev("response.content_part.done", **where, part=_part(text))
            yield ev("response.output_item.done", output_index=0, item=done["output"][0])
            kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
            yield ev(kind, response=done)

    return sse_response(events(), stream, error_event=error_event)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return _store(request).get(response_id, "response_id")[0]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
