"""Chat-output parsers: generated text → answer, reasoning and tool calls, per chat format.

One :class:`ToolFormat` declaration per format names its parser, the chat-template text
that identifies it and how its call ids look. The format is ``server.tool_parser`` from the
config, or (``auto``) the first format whose marker the model's chat template contains.
:func:`make_output_parser` builds the parser one request uses, streaming or not: feed it the
text deltas, then :meth:`ChatOutputParser.finish`; :func:`parse_output` does both at once.

==============  ============================================  ===============================
name            models                                        the template contains
==============  ============================================  ===============================
harmony         gpt-oss                                       ``<|channel|>`` + ``<|message|>``
qwen3_coder     Qwen3-Coder                                   ``<function=`` + ``<parameter=``
hermes          Hermes 2/3, Qwen2.5, Qwen3, QwQ               ``<tool_call>``
deepseek_v3     DeepSeek-V3, R1, V3.1                         ``<｜tool▁calls▁begin｜>``
mistral         Mistral v3 and v11+ tokenizers                ``[TOOL_CALLS]``
llama3_json     Llama 3.1, 3.2, 3.3                           ``<|python_tag|>``
==============  ============================================  ===============================

``<think>`` reasoning is split off for any template that contains ``</think>``.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from zllm.engine.tool_parsers import deepseek_v3, harmony, hermes, llama3_json, mistral, qwen3_coder
from zllm.engine.tool_parsers.base import (
    NewId,
    OutputDelta,
    OutputParser,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    merge,
)
from zllm.engine.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from zllm.engine.tool_parsers.forced import CallGrammar, ForcedCalls
from zllm.engine.tool_parsers.harmony import HarmonyParser
from zllm.engine.tool_parsers.hermes import HermesParser
from zllm.engine.tool_parsers.llama3_json import Llama3JsonParser
from zllm.engine.tool_parsers.mistral import MistralParser, mistral_call_id
from zllm.engine.tool_parsers.qwen3_coder import Qwen3CoderParser
from zllm.engine.tool_parsers.reasoning import END_THINK, ThinkSplitter, prompt_opens_reasoning
from zllm.spec.config import TOOL_PARSER_FORMATS

__all__ = ["FORMATS", "ChatOutputParser", "ForcedCalls", "OutputDelta", "ParsedOutput", "ToolCall", "ToolCallDelta",
           "ToolFormat",
           "detect_format", "make_output_parser", "openai_call_id", "parse_output", "resolve_format"]


def openai_call_id() -> str:
    """``call_`` and 24 hex digits, the shape of OpenAI's tool call ids."""
    return f"call_{secrets.token_hex(12)}"


@attrs.frozen
class ToolFormat:
    """One chat format's tool-call syntax.

    Attributes:
        name: the ``server.tool_parser`` value that selects it.
        parser: the :class:`OutputParser` subclass that reads it.
        template_markers: texts that all appear in a chat template of this format.
        call_grammar: the Lark grammar of a forced block of calls in this syntax
            (:mod:`zllm.engine.tool_parsers.forced`).
        new_id: makes call ids the format's templates accept.
    """

    name: str
    parser: type[OutputParser]
    template_markers: tuple[str, ...]
    call_grammar: CallGrammar
    new_id: NewId = openai_call_id

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker text of the format (the detokenizer must keep them as text)."""
        return tuple(self.parser.markers)  # type: ignore[attr-defined]


# Detection order: the more specific markers first (Qwen3-Coder's templates also say <tool_call>).
FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("harmony", HarmonyParser, ("<|channel|>", "<|message|>"), harmony.call_grammar),
    ToolFormat("qwen3_coder", Qwen3CoderParser, ("<function=", "<parameter="), qwen3_coder.call_grammar),
    ToolFormat("hermes", HermesParser, ("<tool_call>",), hermes.call_grammar),
    ToolFormat("deepseek_v3", DeepSeekV3Parser, ("tool▁calls▁begin",), deepseek_v3.call_grammar),
    ToolFormat("mistral", MistralParser, ("[TOOL_CALLS]",), mistral.call_grammar, mistral_call_id),
    ToolFormat("llama3_json", Llama3JsonParser, ("<|python_tag|>",), llama3_json.call_grammar),
)
_BY_NAME = {f.name: f for f in FORMATS}
assert set(_BY_NAME) == set(TOOL_PARSER_FORMATS), "zllm.spec.config.TOOL_PARSER_FORMATS lists every format"


def detect_format(template: str | None) -> ToolFormat | None:
    """The first format whose markers all appear in ``template``; None for none (or no template)."""
    if not template:
        return None
    return next((f for f in FORMATS if all(m in template for m in f.template_markers)), None)


def resolve_format(setting: str, template: str | None) -> ToolFormat | None:
    """The format for ``server.tool_parser`` (``auto``: detected; ``none``: no parsing)."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_format(template)
    return _BY_NAME[setting]


class _TextParser(OutputParser):
    markers = ()

    def _step(self, final: bool) -> None:
        if self._buf:
            self._out.append(OutputDelta(content=self._buf))
            self._buf = ""


class ChatOutputParser:
    """One request's parser: ``<think>`` splitting, then the format's tool calls.

    Args:
        fmt: the model's format, or None (the answer is plain text).
        tools: the request's tools; empty (or ``parse_tools`` false) leaves tool-call text as
            answer text, except in harmony, whose channels are always read.
        reasoning: split ``<think>`` reasoning off.
        in_reasoning: the prompt ended inside ``<think>``.
        parallel_tool_calls: false keeps the first call only.
        new_id: overrides the format's call ids (tests use a counter).
    """

    def __init__(self, fmt: ToolFormat | None, tools: Sequence[Mapping[str, Any]], *, parse_tools: bool = True,
                 reasoning: bool = False, in_reasoning: bool = False, parallel_tool_calls: bool = True,
                 new_id: NewId | None = None):
        use_format = fmt is not None and ((tools and parse_tools) or fmt.name == "harmony")
        ids = new_id or (fmt.new_id if fmt is not None else openai_call_id)
        self._tools: OutputParser = (fmt.parser if use_format and fmt is not None else _TextParser)(tools, ids)
        self._think = ThinkSplitter(in_reasoning) if reasoning and not (use_format and fmt and fmt.name == "harmony") \
            else None
        self._parallel = parallel_tool_calls
        self.tool_call_count = 0

    def feed(self, text: str) -> OutputDelta:
        """Parse a text delta; return the answer, reasoning and tool-call pieces it adds."""
        return self._step(text, final=False)

    def finish(self) -> OutputDelta:
        """The generation ended: everything still held back."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> OutputDelta:
        reasoning = ""
        if self._think is not None:
            reasoning, text = self._think.feed(text, final)
        out = self._tools.finish() if final and not text else self._tools.feed(text)
        if final and text:
            rest = self._tools.finish()
            out = OutputDelta(out.content + rest.content, out.reasoning_content + rest.reasoning_content,
                              out.tool_calls + rest.tool_calls)
        calls = out.tool_calls if self._parallel else tuple(c for c in out.tool_calls if c.index == 0)
        if calls:
            self.tool_call_count = max(self.tool_call_count, calls[-1].index + 1)
        return OutputDelta(out.content, reasoning + out.reasoning_content, calls)


def make_output_parser(fmt: ToolFormat | None, *, tools: Sequence[Mapping[str, Any]] = (), parse_tools: bool = True,
                       template: str | None = None, prompt_text: str = "", parallel_tool_calls: bool = True,
                       new_id: NewId | None = None) -> ChatOutputParser:
    """The parser for one chat request: reasoning is split when ``template`` has ``</think>``."""
    reasoning = bool(template) and END_THINK in (template or "")
    return ChatOutputParser(fmt, tools, parse_tools=parse_tools, reasoning=reasoning,
                            in_reasoning=reasoning and prompt_opens_reasoning(prompt_text),
                            parallel_tool_calls=parallel_tool_calls, new_id=new_id)


def parse_output(parser: ChatOutputParser, text: str) -> ParsedOutput:
    """A whole generation through ``parser`` (one feed, then finish)."""
    return merge([parser.feed(text), parser.finish()])
