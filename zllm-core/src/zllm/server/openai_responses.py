"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` — OpenAI Responses.

https://platform.openai.com/docs/api-reference/responses. ``input`` (a string or message,
``function_call`` and ``function_call_output`` items) and ``instructions`` (a leading system
message) become the engine's ``messages`` prompt form; function ``tools`` reach the chat
template, and the parsed answer becomes ``reasoning``, ``message`` and ``function_call``
output items. Responses are kept in a bounded in-memory store (the newest
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


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None  # accepted and ignored (an output item echoed back)
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(StrictModel):
    type: str


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted and ignored: zllm adds no padding


class ResponsesRequest(SamplingFields):
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    stop: str | list[str] | None = None  # zllm extension (Responses has no stop field)
    tools: list[dict[str, Any]] | None = None  # function tools; other tool types are rejected
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Rejected with a 400 naming the field (they change generation; zllm does not do them).
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    # Accepted and ignored: they carry no behaviour in a local server.
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
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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


def conversation(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation this request continues (no instructions): history, then ``input``;
    ``function_call`` items join the assistant message before them as its ``tool_calls``, each
    ``function_call_output`` is a ``tool`` message.

    Raises:
        ApiError: 400 naming ``input`` when it is an empty string or list, or
            ``input[i].content`` when a message's content is an empty list.
    """
    if isinstance(body.input, str):
        if not body.input:
            raise ApiError(400, "input: is an empty string; send text or input items", param="input",
                           code="invalid_value")
        return history + [{"role": "user", "content": body.input}]
    if not body.input:
        raise ApiError(400, "input: must hold at least one message item", param="input", code="invalid_value")
    items: list[dict[str, Any]] = []
    for i, m in enumerate(body.input):
        if isinstance(m, InputMessage) and m.content == []:
            raise ApiError(400, f"input[{i}].content: is an empty list; send text or input_text parts",
                           param=f"input[{i}].content", code="invalid_value")
        if isinstance(m, FunctionCallItem):
            call = {"id": m.call_id, "type": "function", "function": {"name": m.name, "arguments": m.arguments}}
            last = items[-1] if items else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                items.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(m, FunctionCallOutputItem):
            items.append({"role": "tool", "tool_call_id": m.call_id, "content": _text(m.output)})
        else:
            items.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)})
    return history + items


def engine_tools(body: ResponsesRequest) -> dict[str, Any]:
    """``tools`` (function tools only), ``tool_choice`` and ``parallel_tool_calls`` in the engine's terms."""
    req: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function":
                raise ApiError(400, f"tools[{i}].type: {t.get('type')!r} tools are not supported by zllm; "
                                    "give function tools", param=f"tools[{i}].type", code="unsupported_parameter")
            try:
                tool = FunctionTool.model_validate(t)
            except ValueError as exc:
                raise ApiError(400, f"tools[{i}]: {exc}", param=f"tools[{i}]", code="invalid_value") from None
            tools.append({"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)})
        req["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        req["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        req["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        req["parallel_tool_calls"] = body.parallel_tool_calls
    return req


def engine_request(body: ResponsesRequest, convo: list[dict[str, Any]]) -> dict[str, Any]:
    for field in ("reasoning", "include", "top_logprobs", "background", "conversation", "prompt"):
        reject_if(getattr(body, field), field)
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise ApiError(400, f"text.format: only type 'text' is supported, got {body.text.format.type!r}",
                       param="text.format", code="unsupported_parameter")
    req = body.engine_fields()
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    req["messages"] = system + convo
    req.update(engine_tools(body))
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

    items = _Items(mid)

    def response(status: str, output: list[dict[str, Any]], final: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = final is not None and final["finish_reason"] == "length"
        return {
            "id": rid, "object": "response", "created_at": created, "model": st.model_name,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"), "tools": body.tools or [],
            "truncation": "disabled",
            "text": {"format": {"type": "text"}}, "metadata": body.metadata or {}, "usage": _usage(final),
        }

    def finished(final: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if final["finish_reason"] == "length" else "completed"
        out = response(status, items.output(final, status), final)
        if body.store is not False:
            answer: dict[str, Any] = {"role": "assistant", "content": final["content"] or None}
            if final["tool_calls"]:
                answer["tool_calls"] = [{"id": c["id"], "type": "function",
                                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                                        for c in final["tool_calls"]]
            else:
                answer["content"] = final["content"]
            store.put(out, convo + [answer])
        return out

    if not body.stream:
        _, final = await run_to_end(stream, request)
        return finished(final)

    seq = iter(range(1 << 62))

    def ev(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    def error_event(err: ApiError) -> str:
        # ResponseErrorEvent: numbered like every other event of the stream.
        return ev("error", code=err.code or _ERROR_TYPES.get(err.status, "server_error"), message=err.message,
                  param=err.param)

    async def events():
        yield ev("response.created", response=response("in_progress", [], None))
        yield ev("response.in_progress", response=response("in_progress", [], None))
        async for event in stream.events():
            if event["type"] == "delta":
                for kind, fields in items.delta(event):
                    yield ev(kind, **fields)
                continue
            done = finished(event)
            for kind, fields in items.close(done["output"], last=True):
                yield ev(kind, **fields)
            kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
            yield ev(kind, response=done)

    return sse_response(events(), stream, error_event=error_event)


class _Items:
    """The output items of one answer — reasoning, message, one function_call per tool call —
    with stable ids, and the streaming events that open, fill and close them in order."""

    def __init__(self, message_id: str):
        self.message_id = message_id
        self.reasoning_id = new_id("rs_")
        self._call_ids: list[str] = []
        self._open: tuple[str, int, dict[str, Any]] | None = None  # (kind, output_index, item)
        self._count = 0
        self._text = ""

    def _fc_id(self, index: int) -> str:
        while len(self._call_ids) <= index:
            self._call_ids.append(new_id("fc_"))
        return self._call_ids[index]

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_part(text)]}

    def reasoning(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def call(self, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": self._fc_id(index), "call_id": call["id"], "name": call["name"],
                "arguments": call["arguments"], "status": status}

    def output(self, final: dict[str, Any], status: str) -> list[dict[str, Any]]:
        """The response's ``output`` for the engine's final event."""
        out = [self.reasoning(final["reasoning_content"])] if final["reasoning_content"] else []
        if final["content"] or not final["tool_calls"]:
            out.append(self.message(final["content"], status))
        out += [self.call(i, c, "completed") for i, c in enumerate(final["tool_calls"])]
        return out

    def _start(self, kind: str, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        self._open, self._text = (kind, self._count, item), ""
        self._count += 1
        out.append(("response.output_item.added", {"output_index": self._count - 1, "item": item}))
        if kind == "message":
            out.append(("response.content_part.added", {**self._where(), "part": _part("")}))
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open[2]["id"], "output_index": self._open[1], "content_index": 0}

    def close(self, output: list[dict[str, Any]] | None = None, last: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """Events closing the open item (with ``output``, the final items, their done form)."""
        out: list[tuple[str, dict[str, Any]]] = []
        if last and self._count == 0:
            out += self._start("message", self.message("", "in_progress"))
        if self._open is None:
            return out
        kind, index, item = self._open
        done = next((o for o in output or () if o["id"] == item["id"]), None)
        if kind == "message":
            out.append(("response.output_text.done", {**self._where(), "text": self._text, "logprobs": []}))
            out.append(("response.content_part.done", {**self._where(), "part": _part(self._text)}))
            done = done or {**self.message(self._text, "completed")}
        elif kind == "reasoning":
            out.append(("response.reasoning_text.done", {**self._where(), "text": self._text}))
            done = done or self.reasoning(self._text)
        else:
            out.append(("response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": self._text}))
            done = done or {**item, "arguments": self._text, "status": "completed"}
        out.append(("response.output_item.done", {"output_index": index, "item": done}))
        self._open = None
        return out

    def delta(self, event: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Events for an engine delta event."""
        out: list[tuple[str, dict[str, Any]]] = []
        if event["reasoning_content"]:
            if self._open is None or self._open[0] != "reasoning":
                out += self.close() + self._start("reasoning", self.reasoning(""))
            self._text += event["reasoning_content"]
            out.append(("response.reasoning_text.delta", {**self._where(), "delta": event["reasoning_content"]}))
        if event["content"]:
            if self._open is None or self._open[0] != "message":
                out += self.close() + self._start("message", self.message("", "in_progress"))
            self._text += event["content"]
            out.append(("response.output_text.delta", {**self._where(), "delta": event["content"], "logprobs": []}))
        for c in event["tool_calls"]:
            if c["id"] is not None:
                out += self.close() + self._start("call", self.call(c["index"], {**c, "arguments": ""}, "in_progress"))
            if c["arguments"]:
                assert self._open is not None
                self._text += c["arguments"]
                out.append(("response.function_call_arguments.delta",
                            {"item_id": self._open[2]["id"], "output_index": self._open[1], "delta": c["arguments"]}))
        return out


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return _store(request).get(response_id, "response_id")[0]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
