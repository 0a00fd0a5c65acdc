"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is one or more call objects, with
``parameters`` (Meta's key) or ``arguments``, optionally after ``<|python_tag|>`` and
separated by ``;``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Reference: Meta's Llama 3.1/3.2 prompt format ("JSON based tool calling") and vLLM's
``llama_tool_parser.py``: an answer that does not start with ``{`` (or the tag) is text.
"""

from __future__ import annotations

from zllm.engine.tool_parsers.base import JsonCallScanner, OutputParser, is_prefix_of_any
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, json_call_head, quoted

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(OutputParser):
    """An answer of JSON call objects becomes tool calls; any other answer stays text."""

    markers = (PYTHON_TAG,)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"
        self._raw = ""  # text held before the first call is known to be one
        self._call: JsonCallScanner | None = None

    def _step(self, final: bool) -> None:
        while self._advance():
            pass
        if final:
            if self._state == "call" and self._call is not None and not self._call.streaming:
                self._finish_object(final=True)
            elif self._state in ("start", "content", "between"):
                self._text(self._raw + self._buf if self._calls == 0 else self._buf.strip(" \t\r\n;"))
            self._buf, self._raw = "", ""

    def _advance(self) -> bool:
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(PYTHON_TAG):
                self._raw += self._buf[: len(self._buf) - len(stripped) + len(PYTHON_TAG)]
                self._buf = stripped[len(PYTHON_TAG):]
                self._state = "between"
                return True
            if stripped.startswith("{"):
                self._state, self._call = "call", JsonCallScanner()
                return True
            if not stripped or is_prefix_of_any(stripped, [PYTHON_TAG]):
                return False
            self._state = "content"
            return True
        if self._state == "content":
            self._text(self._raw + self._buf)
            self._buf, self._raw = "", ""
            return False
        if self._state == "between":  # after the tag or a call: more calls, or the end
            stripped = self._buf.lstrip(" \t\r\n;")
            if not stripped:
                return False
            if stripped.startswith("{"):
                self._raw += self._buf[: len(self._buf) - len(stripped)] if self._calls == 0 else ""
                self._buf, self._state, self._call = stripped, "call", JsonCallScanner()
                return True
            self._state = "content"
            return True
        assert self._state == "call" and self._call is not None
        name, fragment, rest = self._call.feed(self._buf)
        self._buf = ""
        if name is not None:
            self._start_call(name)
        self._arguments(fragment)
        if not self._call.done:
            return False
        self._buf = rest
        self._finish_object(final=False)
        return True

    def _finish_object(self, final: bool) -> None:
        call = self._call
        assert call is not None
        self._call, self._state = None, "between"
        if call.streaming:
            return
        whole = call.whole_call() if call.done else None
        if whole is not None:
            self._raw = ""
            self._start_call(*whole)
            return
        # Not a call object: the rest of the answer is text.
        self._text((self._raw if self._calls == 0 else "") + call.text + self._buf)
        self._buf, self._raw, self._state = "", "", "content"


def call_grammar(forced: ForcedCalls) -> str:
    """Forced calls as Meta's JSON objects with ``parameters``, joined by ``"; "``."""
    def call(f: ForcedCalls, name: str, args: str) -> str:
        return f"{quoted(json_call_head(name, 'parameters'))} {args} {quoted('}')}"
    return calls_grammar(forced, call, separator=quoted("; "))
