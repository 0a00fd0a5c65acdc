"""DeepSeek-V3 / R1 tool calls (full-width bars and ``▁`` are part of the tokens)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and the V3.1 form ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.
Reference: the DeepSeek-V3 / V3.1 chat templates and vLLM's ``deepseekv3_tool_parser.py``
and ``deepseekv31_tool_parser.py``.
"""

from __future__ import annotations

from zllm.engine.tool_parsers.base import OutputParser, is_prefix_of_any, split_at
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, quoted

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekV3Parser(OutputParser):
    """The calls block of DeepSeek-V3 (fenced JSON arguments) or V3.1 (bare JSON)."""

    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "text"

    def _step(self, final: bool) -> None:
        while self._advance():
            pass
        if final:
            if self._state == "text":
                self._text(self._buf)
            elif self._state in ("args", "args31"):
                self._arguments(self._buf)
            self._buf = ""

    def _advance(self) -> bool:
        if self._state == "text":
            before, marker, self._buf = split_at(self._buf, [CALLS_BEGIN])
            self._text(before)
            if marker is None:
                return False
            self._state = "calls"
            return True
        if self._state == "calls":
            stripped = self._buf.lstrip()
            for tag, state in ((CALL_BEGIN, "header"), (CALLS_END, "text")):
                if stripped.startswith(tag):
                    self._buf, self._state = stripped[len(tag):], state
                    return True
            if not stripped or is_prefix_of_any(stripped, [CALL_BEGIN, CALLS_END]):
                return False
            self._state = "text"  # stray text ends the block
            return True
        if self._state == "header":  # "function<｜tool▁sep｜>NAME\n" (V3) or "NAME<｜tool▁sep｜>" (V3.1)
            head, marker, rest = split_at(self._buf, [SEP])
            if marker is None:
                return False
            if head.strip() == "function":
                self._buf, self._state = rest, "name"
            else:
                self._start_call(head.strip())
                self._buf, self._state = rest, "args31"
            return True
        if self._state == "name":
            name, marker, rest = split_at(self._buf, ["\n"])
            if marker is None:
                return False
            self._start_call(name.strip())
            self._buf, self._state = rest, "fence"
            return True
        if self._state == "fence":
            if self._buf.startswith(FENCE_OPEN):
                self._buf, self._state = self._buf[len(FENCE_OPEN):], "args"
                return True
            if is_prefix_of_any(self._buf, [FENCE_OPEN]):
                return False
            self._state = "args"  # no fence: the arguments follow directly
            return True
        if self._state == "args":
            args, marker, self._buf = split_at(self._buf, [FENCE_CLOSE, CALL_END])
            self._arguments(args)
            if marker is None:
                return False
            self._state = "tail" if marker == FENCE_CLOSE else "calls"
            return True
        if self._state == "args31":
            args, marker, self._buf = split_at(self._buf, [CALL_END])
            self._arguments(args)
            if marker is None:
                return False
            self._state = "calls"
            return True
        assert self._state == "tail"
        _, marker, self._buf = split_at(self._buf, [CALL_END])
        if marker is None:
            return False
        self._state = "calls"
        return True


def call_grammar(forced: ForcedCalls) -> str:
    """Forced calls in one calls block: V3's ``function`` type and fenced JSON when the
    template writes the fence, else V3.1's bare JSON."""
    fenced = FENCE_OPEN.strip() in forced.template

    def call(f: ForcedCalls, name: str, args: str) -> str:
        if fenced:
            return (f"{f.literal(CALL_BEGIN)} {quoted('function')} {f.literal(SEP)} "
                    f"{quoted(name + chr(10) + FENCE_OPEN)} {args} {quoted(FENCE_CLOSE)} {f.literal(CALL_END)}")
        return f"{f.literal(CALL_BEGIN)} {quoted(name)} {f.literal(SEP)} {args} {f.literal(CALL_END)}"
    return calls_grammar(forced, call, begin=(forced.literal(CALLS_BEGIN),), end=(forced.literal(CALLS_END),))
