"""Mistral tool calls after the ``[TOOL_CALLS]`` control token, in both tokenizer versions:

- v3 (Mistral 7B v0.3, Mixtral 8x22B): a JSON list,
  ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]``;
- v11+ (Mistral Small 3.1+, Magistral, Devstral): ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``,
  one ``[TOOL_CALLS]`` per call.

Call ids are 9 alphanumerics, which Mistral's templates require of the ids they are sent back.
Reference: ``mistral_common`` (``tokens/tokenizers/instruct.py``) and vLLM's ``mistral_tool_parser.py``.
"""

from __future__ import annotations

import secrets
import string

from zllm.engine.tool_parsers.base import JsonCallScanner, JsonDepth, OutputParser, split_at
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, json_call_head, quoted

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A random 9-character alphanumeric tool call id."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralParser(OutputParser):
    """``[TOOL_CALLS]`` followed by a v3 JSON list or by v11 ``name[ARGS]{…}`` calls."""

    markers = (TOOL_CALLS, ARGS)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "text"
        self._call: JsonCallScanner | None = None
        self._depth: JsonDepth | None = None

    def _step(self, final: bool) -> None:
        while self._advance():
            pass
        if final:
            if self._state == "text":
                self._text(self._buf)
            elif self._state == "list_item" and self._call is not None and not self._call.streaming:
                whole = self._call.whole_call() if self._call.done else None
                if whole is not None:
                    self._start_call(*whole)
            self._buf = ""

    def _advance(self) -> bool:
        if self._state == "text":
            before, marker, self._buf = split_at(self._buf, [TOOL_CALLS])
            self._text(before)
            if marker is None:
                return False
            self._state = "after_tag"
            return True
        if self._state == "after_tag":
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            if stripped.startswith("["):
                self._buf, self._state = stripped[1:], "list"
            else:
                self._buf, self._state = stripped, "name"
            return True
        if self._state == "list":  # inside the v3 list, between items
            stripped = self._buf.lstrip(" \t\r\n,")
            if not stripped:
                self._buf = ""
                return False
            if stripped.startswith("{"):
                self._buf, self._state, self._call = stripped, "list_item", JsonCallScanner()
            else:  # "]" or stray text ends the list
                self._buf, self._state = stripped[1:] if stripped.startswith("]") else stripped, "text"
            return True
        if self._state == "list_item":
            assert self._call is not None
            name, fragment, rest = self._call.feed(self._buf)
            self._buf = ""
            if name is not None:
                self._start_call(name)
            self._arguments(fragment)
            if not self._call.done:
                return False
            if not self._call.streaming:
                whole = self._call.whole_call()
                if whole is not None:
                    self._start_call(*whole)
            self._buf, self._state, self._call = rest, "list", None
            return True
        if self._state == "name":  # v11: NAME[ARGS]
            name, marker, rest = split_at(self._buf, [ARGS])
            if marker is None:
                return False
            self._start_call(name.strip())
            self._buf, self._state, self._depth = rest, "args", JsonDepth()
            return True
        assert self._state == "args" and self._depth is not None
        if self._depth.depth == 0 and not self._depth.in_string:
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf = stripped
        for i, ch in enumerate(self._buf):
            if self._depth.push(ch) == 0 and not self._depth.in_string:
                self._arguments(self._buf[: i + 1])
                self._buf, self._state = self._buf[i + 1:], "text"
                return True
        self._arguments(self._buf)
        self._buf = ""
        return False


def call_grammar(forced: ForcedCalls) -> str:
    """Forced calls in the tokenizer version the template writes: v11+ (its template says
    ``[ARGS]``) one ``[TOOL_CALLS]name[ARGS]{…}`` per call, v3 one ``[TOOL_CALLS]`` and a
    JSON list."""
    if ARGS in forced.template:
        def v11(f: ForcedCalls, name: str, args: str) -> str:
            return f"{f.literal(TOOL_CALLS)} {quoted(name)} {f.literal(ARGS)} {args}"
        return calls_grammar(forced, v11)

    def v3(f: ForcedCalls, name: str, args: str) -> str:
        return f"{quoted(json_call_head(name, 'arguments'))} {args} {quoted('}')}"
    return calls_grammar(forced, v3, begin=(forced.literal(TOOL_CALLS), quoted(" [")), separator=quoted(", "),
                         end=(quoted("]"),))
