"""Qwen3-Coder's XML tool calls, parameter values cast by the tool's JSON schema::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Reference: Qwen3-Coder's chat template and vLLM's ``qwen3coder_tool_parser.py`` (one newline
at each end of a value is layout, not value; a value is cast by its parameter's schema
``type``, and kept a string when that fails or the parameter is not in the schema).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from zllm.engine.tool_parsers.base import OutputParser, is_prefix_of_any, split_at
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, quoted

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def cast_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """The JSON value of a parameter's text, by its JSON-schema ``type`` (first of a list)."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if raw.strip().lower() == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(raw.strip())
        if kind == "number":
            value = float(raw.strip())
            return int(value) if value.is_integer() and "." not in raw and "e" not in raw.lower() else value
        if kind == "boolean":
            lowered = raw.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            return raw
        if kind in ("object", "array"):
            return json.loads(raw)
    except ValueError:
        return raw
    return raw


class Qwen3CoderParser(OutputParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>``."""

    markers = (OPEN, CLOSE, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "text"
        self._raw = ""  # the call's text so far, given back as text if it is no call
        self._function: Mapping[str, Any] = {}
        self._param: str | None = None
        self._params = 0

    def _step(self, final: bool) -> None:
        while self._advance(final):
            pass
        if final:
            if self._state == "text":
                self._text(self._buf)
            elif self._state in ("open", "stray"):
                self._text(OPEN + self._raw + self._buf)
            elif self._state != "tail":
                if self._state == "value" and self._param is not None:
                    self._emit_param(self._buf)
                self._close_call()
            self._buf, self._state = "", "text"

    def _advance(self, final: bool) -> bool:
        """One transition of the state machine; False when it needs more text."""
        if self._state == "text":
            before, marker, self._buf = split_at(self._buf, [OPEN])
            self._text(before)
            if marker is None:
                return False
            self._state, self._raw = "open", ""
            return True
        if self._state == "open":  # expecting <function=NAME>
            stripped = self._buf.lstrip()
            if stripped.startswith(FUNCTION):
                name, marker, rest = split_at(stripped[len(FUNCTION):], [">"])
                if marker is None:
                    return False
                self._function = self.tools.get(name, {})
                self._start_call(name)
                self._buf, self._state, self._params = rest, "params", 0
                return True
            if not stripped or is_prefix_of_any(stripped, [FUNCTION]):
                return False
            self._state = "stray"
            return True
        if self._state == "stray":  # no function inside this <tool_call>: it was text after all
            before, marker, after = split_at(self._buf, [CLOSE])
            self._raw += before
            self._buf = after
            if marker is None:
                return False
            self._text(OPEN + self._raw + CLOSE)
            self._state = "text"
            return True
        if self._state == "params":  # expecting <parameter=KEY>, </function> or </tool_call>
            stripped = self._buf.lstrip()
            for tag, state in ((PARAMETER, "key"), (FUNCTION_END, "tail"), (CLOSE, "text")):
                if stripped.startswith(tag):
                    self._buf = stripped[len(tag):]
                    if tag != PARAMETER:
                        self._close_call()
                    self._state = state
                    return True
            if not stripped or is_prefix_of_any(stripped, [PARAMETER, FUNCTION_END, CLOSE]):
                return False
            # Stray text between parameters: skip up to the next tag.
            before, marker, after = split_at(stripped, [PARAMETER, FUNCTION_END, CLOSE])
            self._buf = (marker or "") + after
            return marker is not None
        if self._state == "key":
            key, marker, rest = split_at(self._buf, [">"])
            if marker is None:
                return False
            self._param, self._buf, self._state = key, rest, "value"
            return True
        if self._state == "value":
            # A value ends at </parameter>; the model sometimes leaves that out before the next tag.
            value, marker, rest = split_at(self._buf, [PARAMETER_END, PARAMETER, FUNCTION_END, CLOSE])
            if marker is None:
                return False
            self._emit_param(value)
            self._buf = rest if marker == PARAMETER_END else marker + rest
            self._state = "params"
            return True
        assert self._state == "tail"  # after </function>, up to </tool_call>
        _, marker, self._buf = split_at(self._buf, [CLOSE])
        if marker is None:
            return False
        self._state = "text"
        return True

    def _emit_param(self, raw: str) -> None:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        assert self._param is not None
        schema = (self._function.get("parameters") or {}).get("properties", {}).get(self._param)
        value = cast_value(raw, schema)
        head = "{" if self._params == 0 else ", "
        self._arguments(f"{head}{json.dumps(self._param, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        self._params += 1
        self._param = None

    def _close_call(self) -> None:
        self._arguments("}" if self._params else "{}")
        self._params = -1  # closed


_TEXT_VALUE = r"/[^<\n]([^<]*[^<\n])?/"  # a string parameter's text: no markup, no layout newline at its ends


def _parameter_value(forced: ForcedCalls, schema: Mapping[str, Any]) -> str:
    """A Lark expression for one parameter's text: strings as plain text (their enum, or a
    single line within their length bounds, when they have them), every other type as JSON
    (what :func:`cast_value` reads back)."""
    if schema.get("type") != "string":
        return forced.json_rule(schema)
    if schema.get("enum"):
        return "(" + " | ".join(quoted(v) for v in schema["enum"]) + ")"
    if "maxLength" in schema or "minLength" in schema:
        low, high = max(1, int(schema.get("minLength", 1))), schema.get("maxLength")
        return quoted("") if high == 0 else f"/[^<\\n]{{{low},{'' if high is None else int(high)}}}/"
    return _TEXT_VALUE


def call_grammar(forced: ForcedCalls) -> str:
    """Forced calls in Qwen3-Coder's XML: every required parameter, then each optional one
    or not, in the schema's order, each value on its own lines."""
    schemas = dict(forced.tools)
    nl = quoted("\n")

    def call(f: ForcedCalls, name: str, args: str) -> str:
        schema = schemas[name]
        required = set(schema.get("required", ()))
        parts = []
        for key, prop in (schema.get("properties") or {}).items():
            part = (f"{f.literal(PARAMETER)} {quoted(key + '>' + chr(10))} {_parameter_value(f, prop)} {nl} "
                    f"{f.literal(PARAMETER_END)} {nl}")
            parts.append(f"({part})" if key in required else f"({part})?")
        return (f"{f.literal(OPEN)} {nl} {f.literal(FUNCTION)} {quoted(name + '>' + chr(10))} {' '.join(parts)} "
                f"{f.literal(FUNCTION_END)} {nl} {f.literal(CLOSE)}")
    return calls_grammar(forced, call, separator=nl)
