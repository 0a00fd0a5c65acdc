"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` — OpenAI Responses.

https://platform.openai.com/docs/api-reference/responses. ``input`` (a string or message,
``function_call`` and ``function_call_output`` items) and ``instructions`` (a leading system
message) become the engine's ``messages`` prompt form; function ``tools`` reach the chat
template, and the parsed answer becomes ``reasoning``, ``message`` and ``function_call``
output items; ``text.format`` becomes the engine's ``response_format`` and ``include`` of
``message.output_text.logprobs`` its ``logprobs`` (:func:`engine_request`). Responses are
kept in a bounded in-memory store (the newest :data:`STORE_CAPACITY`, unless ``store:
false``) so ``previous_response_id`` can continue a conversation and ``GET
/v1/responses/{id}`` can fetch one; a restart forgets them.
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
from zllm.server.logprobs import chat_logprobs

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


class TextConfig(StrictModel):
    format: dict[str, Any] | None = None  # checked by engine_format
    verbosity: str | None = None  # accepted and ignored


# text.format type -> the keys it may carry (besides type).
_FORMAT_KEYS = {"text": (), "json_object": (), "json_schema": ("name", "schema", "strict", "description"),
                "regex": ("regex",), "grammar": ("grammar",)}

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Other include values OpenAI defines: each asks for a part of an item zllm never produces
# (tool outputs of hosted tools, images, encrypted reasoning), so there is nothing to add.
_IGNORED_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})


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
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Rejected with a 400 naming the field (they change generation; zllm does not do them).
    reasoning: dict[str, Any] | None = None
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


RENAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "response_format.json_schema": "text.format",
           "tool_choice.function": "tool_choice", "tools[*].function": "tools[*]", "logprobs": "top_logprobs"}


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


def engine_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as the engine's ``response_format`` (None for plain text): OpenAI's
    ``json_schema`` format keeps ``name``, ``schema``, ``strict`` and ``description`` at the
    top, where Chat nests them in ``json_schema``; zllm's ``regex`` and ``grammar`` pass as they are.

    Raises:
        ApiError: 400 naming ``text.format.type`` for an unknown type, or the key it does not take.
    """
    kind = fmt.get("type")
    if kind not in _FORMAT_KEYS:
        raise ApiError(400, f"text.format.type: expected one of {', '.join(map(repr, _FORMAT_KEYS))}, got {kind!r}",
                       param="text.format.type", code="invalid_value")
    for key in fmt:
        if key != "type" and key not in _FORMAT_KEYS[kind]:
            raise ApiError(400, f"text.format.{key}: unknown field for a {kind!r} format (it takes "
                                f"{', '.join(('type', *_FORMAT_KEYS[kind]))})",
                           param=f"text.format.{key}", code="invalid_value")
    if kind == "text":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


def logprobs_field(body: ResponsesRequest) -> int | None:
    """The engine's ``logprobs`` (alternatives per token) when ``include`` asks for the output
    text's logprobs, else None.

    Raises:
        ApiError: 400 naming ``include[i]`` for a value OpenAI does not define, or
            ``top_logprobs`` given without the logprobs include.
    """
    wanted = False
    for i, item in enumerate(body.include or ()):
        if item == LOGPROBS_INCLUDE:
            wanted = True
        elif item not in _IGNORED_INCLUDES:
            raise ApiError(400, f"include[{i}]: unknown value {item!r}; zllm includes {LOGPROBS_INCLUDE!r} "
                                f"(and accepts and ignores {', '.join(sorted(_IGNORED_INCLUDES))})",
                           param=f"include[{i}]", code="invalid_value")
    if not wanted:
        if body.top_logprobs is not None:
            raise ApiError(400, f"top_logprobs: needs include: [{LOGPROBS_INCLUDE!r}]", param="top_logprobs",
                           code="invalid_value")
        return None
    return 0 if body.top_logprobs is None else body.top_logprobs


def engine_request(body: ResponsesRequest, convo: list[dict[str, Any]]) -> dict[str, Any]:
    for field in ("reasoning", "background", "conversation", "prompt"):
        reject_if(getattr(body, field), field)
    req = body.engine_fields()
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    req["messages"] = system + convo
    req.update(engine_tools(body))
    if body.text is not None and body.text.format is not None:
        fmt = engine_format(body.text.format)
        if fmt is not None:
            req["response_format"] = fmt
    logprobs = logprobs_field(body)
    if logprobs is not None:
        req["logprobs"] = logprobs
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
    fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}

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
            "text": {"format": fmt}, "top_logprobs": body.top_logprobs, "metadata": body.metadata or {},
            "usage": _usage(final),
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

    return sse_response(events(), [stream], error_event=error_event)


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
        self._logprobs: list[dict[str, Any]] = []  # the open message's, as streamed
        self._message_logprobs: list[dict[str, Any]] = []  # every content delta's

    def _fc_id(self, index: int) -> str:
        while len(self._call_ids) <= index:
            self._call_ids.append(new_id("fc_"))
        return self._call_ids[index]

    def message(self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_part(text, logprobs)]}

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
            # A non-streamed answer's final event carries every token's logprobs (run_to_end);
            # a stream's final event none, and its message has the content deltas' ones.
            logprobs = _logprobs(final["logprobs"]) if "logprobs" in final else self._message_logprobs
            out.append(self.message(final["content"], status, logprobs))
        out += [self.call(i, c, "completed") for i, c in enumerate(final["tool_calls"])]
        return out

    def _start(self, kind: str, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        self._open, self._text, self._logprobs = (kind, self._count, item), "", []
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
            out.append(("response.output_text.done",
                        {**self._where(), "text": self._text, "logprobs": self._logprobs}))
            out.append(("response.content_part.done", {**self._where(), "part": _part(self._text, self._logprobs)}))
            done = done or {**self.message(self._text, "completed", self._logprobs)}
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
            logprobs = _logprobs(event["logprobs"])
            self._logprobs += logprobs
            self._message_logprobs += logprobs
            out.append(("response.output_text.delta",
                        {**self._where(), "delta": event["content"], "logprobs": logprobs}))
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


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """An ``output_text`` part's ``logprobs`` (``[{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}]``, Chat's entries) from the engine's; [] when not asked for."""
    return chat_logprobs(entries)["content"] if entries else []
