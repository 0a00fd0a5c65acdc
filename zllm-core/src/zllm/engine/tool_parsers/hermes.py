"""Hermes-style tool calls, used by Hermes 2/3, Qwen2.5, Qwen3 and QwQ chat templates::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One JSON object per ``<tool_call>`` block, any number of blocks. Reference: the templates'
own instructions ("return a json object with function name and arguments within
<tool_call></tool_call> XML tags") and vLLM's ``hermes_tool_parser.py``.
"""

from __future__ import annotations

from zllm.engine.tool_parsers.base import JsonCallScanner, OutputParser, split_at
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, json_call_head, quoted

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(OutputParser):
    """``<tool_call>{json}</tool_call>`` blocks; a block that is not a call object stays text."""

    markers = (OPEN, CLOSE)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call: JsonCallScanner | None = None

    def _step(self, final: bool) -> None:
        while True:
            if self._call is None:
                before, marker, self._buf = split_at(self._buf, [OPEN])
                self._text(before)
                if marker is None:
                    if final:
                        self._text(self._buf)
                        self._buf = ""
                    return
                self._call = JsonCallScanner()
                continue
            before, marker, after = split_at(self._buf, [CLOSE])
            call = self._call
            name, fragment, _ = call.feed(before)
            if name is not None:
                self._start_call(name)
            self._arguments(fragment)
            self._buf = after
            if marker is None and not final:
                return
            if not call.streaming:
                whole = call.whole_call()
                if whole is not None:
                    self._start_call(*whole)
                else:
                    self._text(OPEN + call.text + (marker or self._buf))
            if marker is None:
                self._buf = ""
                return
            self._call = None


def call_grammar(forced: ForcedCalls) -> str:
    """Forced calls in Hermes' form, one ``<tool_call>`` block each, joined by a newline."""
    def call(f: ForcedCalls, name: str, args: str) -> str:
        head = quoted("\n" + json_call_head(name, "arguments"))
        return f"{f.literal(OPEN)} {head} {args} {quoted('}' + chr(10))} {f.literal(CLOSE)}"
    return calls_grammar(forced, call, separator=quoted("\n"))
