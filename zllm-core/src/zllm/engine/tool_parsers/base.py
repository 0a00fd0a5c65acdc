"""What every chat-output parser shares: the delta types, marker splitting, a streaming
scanner for JSON call objects, and the base class that turns parsed pieces into deltas.

A parser is fed the generated text in arbitrary pieces (:meth:`OutputParser.feed`) and then
:meth:`OutputParser.finish`; each call returns an :class:`OutputDelta`. Text that could still
turn out to be part of a marker (``"<tool"`` before ``"_call>"``) is held back, so the
concatenated deltas never depend on how the text was chunked: feeding the whole text at once
gives the same content, reasoning and tool calls as feeding it one character at a time
(tests/tool_parsers check this with hypothesis for every format).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

NewId = Callable[[], str]
"""Makes the id of a new tool call (``call_…`` for OpenAI; 9 alphanumerics for Mistral)."""


@attrs.frozen
class ToolCallDelta:
    """A piece of tool call number ``index`` (0-based, in output order).

    Attributes:
        index: which call.
        id: the call's id, on its first delta only (else None).
        name: the function's name, on its first delta only (else None).
        arguments: a fragment of the arguments' JSON text; a call's fragments concatenate to
            its final ``arguments`` string (possibly empty on the first delta).
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@attrs.frozen
class OutputDelta:
    """What one :meth:`OutputParser.feed` or :meth:`~OutputParser.finish` adds: answer text,
    reasoning text and tool-call pieces (each possibly empty)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@attrs.frozen
class ToolCall:
    """A whole tool call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class ParsedOutput:
    """A whole generation, parsed: what the concatenated deltas of a stream add up to."""

    content: str
    reasoning_content: str
    tool_calls: tuple[ToolCall, ...]


def merge(deltas: Sequence[OutputDelta]) -> ParsedOutput:
    """Concatenate a stream's deltas into the whole :class:`ParsedOutput`."""
    content, reasoning = [], []
    calls: list[dict[str, Any]] = []
    for d in deltas:
        content.append(d.content)
        reasoning.append(d.reasoning_content)
        for c in d.tool_calls:
            if c.index == len(calls):
                assert c.id is not None and c.name is not None, c
                calls.append({"id": c.id, "name": c.name, "arguments": c.arguments})
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.name is None, c
                calls[-1]["arguments"] += c.arguments
    return ParsedOutput("".join(content), "".join(reasoning), tuple(ToolCall(**c) for c in calls))


def split_at(buf: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """Split ``buf`` at the earliest of ``markers``: ``(before, marker, after)``.

    With no marker in ``buf``: ``(safe, None, held)`` where ``held`` is the longest suffix of
    ``buf`` that is a proper prefix of some marker (it may still grow into one) and ``safe``
    the rest. A tie between markers at one position goes to the longest.
    """
    best: tuple[int, int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or (i, -len(m)) < best[:2]):
            best = (i, -len(m), m)
    if best is not None:
        i, _, m = best
        return buf[:i], m, buf[i + len(m):]
    hold = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), hold, -1):
            if buf.endswith(m[:n]):
                hold = n
                break
    return buf[: len(buf) - hold], None, buf[len(buf) - hold:]


def is_prefix_of_any(text: str, candidates: Sequence[str]) -> bool:
    return any(c.startswith(text) for c in candidates)


class JsonDepth:
    """Structural depth of JSON text read one character at a time (strings and escapes
    understood): ``{``/``[`` open, ``}``/``]`` close."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escape = False

    def push(self, ch: str) -> int:
        if self.in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        return self.depth


# ``{"name": "...", "arguments": `` (or ``"parameters"``, Llama 3's key) up to the first
# character of the value: the lookahead makes the match independent of how text was chunked.
_CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class JsonCallScanner:
    """One JSON call object ``{"name": N, "arguments": {...}}`` read as it arrives.

    When the object starts with its name and an object-valued ``arguments`` (or
    ``parameters``), :meth:`feed` reports the name as soon as it is complete and then the
    arguments' raw JSON text piece by piece. Any other shape (arguments first, arguments as
    a string) is only known when the object is complete; :meth:`whole_call` reads it then.
    """

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.done = False  # the outer object closed
        self._depth = JsonDepth()
        self._scanned = 0
        self._started = False  # the first "{" was seen
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._emitted = 0

    def feed(self, text: str) -> tuple[str | None, str, str]:
        """Read more of the object: ``(name if just found, arguments fragment, rest)``;
        ``rest`` is text after the object's closing brace (not consumed)."""
        self.text += text
        new_name = None
        if self.name is None and self._args_start is None:
            m = _CALL_PREFIX.match(self.text)
            if m and self.text[m.end()] in "{[":
                self.name = new_name = json.loads(f'"{m.group(1)}"')
                self._args_start = self._emitted = m.end()
        rest = ""
        while self._scanned < len(self.text) and not self.done:
            ch = self.text[self._scanned]
            depth = self._depth.push(ch)
            self._scanned += 1
            if ch in "{[" and not self._depth.in_string and depth == 1:
                self._started = True
            if self._args_start is not None and self._args_end is None and self._scanned > self._args_start \
                    and depth == 1 and not self._depth.in_string:
                self._args_end = self._scanned
            if self._started and depth == 0 and not self._depth.in_string:
                self.done = True
                rest = self.text[self._scanned:]
                self.text = self.text[: self._scanned]
        fragment = ""
        if self._args_start is not None:
            end = self._args_end if self._args_end is not None else self._scanned
            fragment, self._emitted = self.text[self._emitted:end], max(self._emitted, end)
        return new_name, fragment, rest

    @property
    def streaming(self) -> bool:
        """Whether the name (and arguments) are being reported as they arrive."""
        return self.name is not None

    def whole_call(self) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` of a complete object of another shape, or None when the
        text is no call object (not JSON, no string ``name``, no ``arguments``)."""
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return obj["name"], args
        return obj["name"], json.dumps(args, ensure_ascii=False)


class OutputParser:
    """Base of every format's parser: subclasses implement :meth:`_step` over ``self._buf``
    and report through :meth:`_text`, :meth:`_reasoning`, :meth:`_start_call` and
    :meth:`_arguments`.

    Whitespace next to tool calls is dropped (the newlines between ``</tool_call>`` and the
    next ``<tool_call>``, or before the first one); to decide that, trailing whitespace of the
    answer text is held until non-space text follows.

    Args:
        tools: the request's tools (``{"type": "function", "function": {"name", "parameters"}}``),
            for formats that cast values by the parameters' JSON schema.
        new_id: makes each call's id.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]], new_id: NewId):
        self.tools = {t["function"]["name"]: t["function"] for t in tools}
        self._new_id = new_id
        self._buf = ""
        self._out: list[OutputDelta] = []
        self._pending_ws = ""
        self._calls = 0
        self._after_call = False

    def feed(self, text: str) -> OutputDelta:
        """Parse more generated text; return what it adds."""
        self._buf += text
        self._step(final=False)
        return self._collect()

    def finish(self) -> OutputDelta:
        """The generation ended: report everything still held back."""
        self._step(final=True)
        if self._calls == 0 and self._pending_ws:
            self._out.append(OutputDelta(content=self._pending_ws))
        self._pending_ws = ""
        return self._collect()

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    def _collect(self) -> OutputDelta:
        out, self._out = self._out, []
        if len(out) == 1:
            return out[0]
        return OutputDelta("".join(d.content for d in out), "".join(d.reasoning_content for d in out),
                           tuple(c for d in out for c in d.tool_calls))

    def _text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if body:
            self._out.append(OutputDelta(content=body))

    def _reasoning(self, text: str) -> None:
        if text:
            self._out.append(OutputDelta(reasoning_content=text))

    def _start_call(self, name: str, arguments: str = "") -> None:
        self._pending_ws = ""
        self._out.append(OutputDelta(tool_calls=(ToolCallDelta(self._calls, self._new_id(), name, arguments),)))
        self._calls += 1
        self._after_call = True

    def _arguments(self, fragment: str) -> None:
        if fragment:
            assert self._calls > 0
            self._out.append(OutputDelta(tool_calls=(ToolCallDelta(self._calls - 1, None, None, fragment),)))
