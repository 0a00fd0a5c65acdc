"""OpenAI's harmony format (gpt-oss): every message has a header and a channel::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city":"Paris"}<|call|>

(one line in the output; wrapped here)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

``analysis`` is reasoning, ``final`` (and ``commentary`` addressed to no one: preambles) is the
answer, a message addressed ``to=functions.NAME`` (in the header, before or after the
channel) is a call whose body is the arguments. Reference: the ``openai-harmony`` format
guide (https://cookbook.openai.com/articles/openai-harmony); tested on golden strings since
the gpt-oss tokenizer is not available offline.
"""

from __future__ import annotations

import re

from zllm.engine.tool_parsers.base import OutputParser, split_at
from zllm.engine.tool_parsers.forced import ForcedCalls, calls_grammar, quoted

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser(OutputParser):
    """Harmony messages: analysis → reasoning, final/commentary → answer, ``to=functions.X`` → calls."""

    markers = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
    has_reasoning = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = "header"
        self._header = ""
        self._target = "content"

    def _step(self, final: bool) -> None:
        while self._advance():
            pass
        if final:
            if self._state == "header":
                self._text(self._header + self._buf)  # no harmony structure: plain text
            else:
                self._emit(self._buf)
            self._buf, self._header = "", ""

    def _advance(self) -> bool:
        if self._state == "header":
            before, marker, self._buf = split_at(self._buf, [MESSAGE])
            self._header += before
            if marker is None:
                return False
            recipient = _RECIPIENT.search(self._header)
            channel = _CHANNEL.search(self._header)
            if recipient:
                self._target = "call"
                self._start_call(recipient.group(1))
            elif channel and channel.group(1) == "analysis":
                self._target = "reasoning"
            else:
                self._target = "content"
            self._header, self._state = "", "body"
            return True
        body, marker, self._buf = split_at(self._buf, [END, CALL, RETURN, START])
        self._emit(body)
        if marker is None:
            return False
        self._state = "header"
        return True

    def _emit(self, text: str) -> None:
        if self._target == "call":
            self._arguments(text)
        elif self._target == "reasoning":
            self._reasoning(text)
        else:
            self._text(text)


def call_grammar(forced: ForcedCalls) -> str:
    """A forced call as one commentary message to ``functions.NAME`` with JSON arguments;
    ``<|call|>`` ends the generation, so there is one call per answer."""
    def call(f: ForcedCalls, name: str, args: str) -> str:
        return (f"{f.literal(CHANNEL)} {quoted(f'commentary to=functions.{name} ')} {f.literal(CONSTRAIN)} "
                f"{quoted('json')} {f.literal(MESSAGE)} {args} {f.literal(CALL)}")
    return calls_grammar(forced, call, parallel=False)
