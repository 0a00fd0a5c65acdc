"""A chat request's generated text → the Request JSON's answer fields.

:class:`ChatAnswer` runs one request's :class:`~zllm.engine.tool_parsers.ChatOutputParser`
over the engine's text deltas and builds the ``content`` / ``reasoning_content`` /
``tool_calls`` fields of its delta events, final event and response
(:mod:`zllm.spec.request`); it decides ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

from typing import Any

from zllm.engine.tool_parsers import ChatOutputParser, OutputDelta, ToolFormat
from zllm.engine.tool_parsers.base import merge
from zllm.engine.tool_parsers.reasoning import END_THINK, prompt_opens_reasoning
from zllm.spec.request import FinishReason, GenerationRequest
from zllm.tokenizer.chat import render_chat_text


def prompt_in_reasoning(tokenizer, req: GenerationRequest) -> bool:
    """Whether a ``messages`` request's rendered prompt ends inside ``<think>`` (only a
    template with reasoning renders the prompt's text to find out)."""
    if req.messages is None or END_THINK not in (tokenizer.chat_template or ""):
        return False
    return prompt_opens_reasoning(render_chat_text(tokenizer, [m.to_dict() for m in req.messages],
                                                   tools=req.tools or None))


def output_parser(fmt: ToolFormat | None, tokenizer, req: GenerationRequest,
                  in_reasoning: bool = False) -> ChatOutputParser | None:
    """The parser of a ``messages`` request (None for ``prompt`` / ``prompt_token_ids``);
    ``in_reasoning`` as :func:`prompt_in_reasoning` says."""
    if req.messages is None:
        return None
    return ChatOutputParser(fmt, req.tools, parse_tools=req.parses_tools,
                            reasoning=END_THINK in (tokenizer.chat_template or ""), in_reasoning=in_reasoning,
                            parallel_tool_calls=req.parallel_tool_calls)


class ChatAnswer:
    """The answer fields of one request, built as its text arrives (``parser`` None: the text
    is the answer)."""

    def __init__(self, parser: ChatOutputParser | None):
        self._parser = parser
        self._deltas: list[OutputDelta] = []

    def delta(self, text: str, final: bool = False) -> dict[str, Any]:
        """``content``, ``reasoning_content`` and ``tool_calls`` pieces for a text delta
        (``final``: the generation ended; ``text`` is then usually "")."""
        if self._parser is None:
            d = OutputDelta(content=text)
        else:
            d = self._parser.feed(text)
            if final:
                rest = self._parser.finish()
                d = OutputDelta(d.content + rest.content, d.reasoning_content + rest.reasoning_content,
                                d.tool_calls + rest.tool_calls)
        self._deltas.append(d)
        return {"content": d.content, "reasoning_content": d.reasoning_content,
                "tool_calls": [{"index": c.index, "id": c.id, "name": c.name, "arguments": c.arguments}
                               for c in d.tool_calls]}

    def whole(self) -> dict[str, Any]:
        """The whole answer so far: ``content``, ``reasoning_content``, ``tool_calls``
        (``{"id", "name", "arguments"}`` each)."""
        out = merge(self._deltas)
        return {"content": out.content, "reasoning_content": out.reasoning_content,
                "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in out.tool_calls]}

    def finish_reason(self, reason: FinishReason) -> FinishReason:
        """``tool_calls`` when an answer that ended by itself made calls, else ``reason``."""
        if reason == "stop" and any(d.tool_calls for d in self._deltas):
            return "tool_calls"
        return reason
