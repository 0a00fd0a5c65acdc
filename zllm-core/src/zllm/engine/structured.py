"""A request's structured output: ``response_format`` and forced tool calls → a grammar
matcher for the runtime (:mod:`zllm.runtime.grammar`).

:class:`StructuredOutput` belongs to one engine. :meth:`StructuredOutput.constraint` runs in
the thread that submits a request, so compiling a new grammar never stalls the engine loop;
compiled grammars are cached by their definition, so a repeated schema costs a copy.
"""

from __future__ import annotations

from zllm.engine.tool_parsers import ForcedCalls, ToolFormat
from zllm.engine.tool_parsers.forced import ANY_OBJECT
from zllm.engine.tool_parsers.reasoning import END_THINK, THINK
from zllm.runtime.grammar import (
    AfterReasoning,
    GrammarCompileError,
    GrammarCompiler,
    json_schema_grammar,
    json_schema_rule,
    lark_grammar,
    regex_grammar,
)
from zllm.runtime.sequence import TokenConstraint
from zllm.spec.errors import RequestError, UnsupportedRequestError
from zllm.spec.request import GenerationRequest
from zllm.tokenizer import Tokenizer


class StructuredOutput:
    """Grammars for one model: its tokenizer, logits width, EOS ids and tool-call format.

    Args:
        tokenizer: the model's tokenizer (its chat template picks format versions).
        vocab_size: the width ``V`` of the logits tokens are sampled from
            (:attr:`zllm.runtime.llm_engine.LLMEngine.sample_width`).
        eos_token_ids: ids that end a sequence.
        tool_format: the chat format forced tool calls are written in, or None.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 tool_format: ToolFormat | None):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._tokenizer = tokenizer
        self._format = tool_format
        self._template = tokenizer.chat_template or ""
        self._think_end = tokenizer.token_to_id(END_THINK) if END_THINK in self._template else None
        self._think_start = tokenizer.token_to_id(THINK) if self._think_end is not None else None
        markers = (*(tool_format.markers if tool_format is not None else ()), THINK, END_THINK)
        self.marker_ids = frozenset(i for m in markers if (i := self.compiler.special_token(m)) is not None)
        """Special tokens that are a chat format's markers: a chat request's text keeps them,
        so its output parser sees ``[TOOL_CALLS]`` or ``<|python_tag|>``."""

    def grammar(self, req: GenerationRequest) -> tuple[str, str] | None:
        """``(llguidance grammar definition, the request field it comes from)``, or None
        for an unconstrained request.

        Raises:
            RequestError: a forced tool call on a model whose chat format zllm cannot name,
                or a Lark/GBNF grammar that does not convert.
        """
        if req.forced_tools and req.messages is not None:
            if self._format is None:
                raise RequestError("tool_choice", "forcing a tool call needs the model's tool-call format, and its "
                                                  "chat template matches none zllm knows; set server.tool_parser")
            forced = ForcedCalls(
                tools=tuple((t["function"]["name"], t["function"].get("parameters") or ANY_OBJECT)
                            for t in req.forced_tools),
                parallel=req.parallel_tool_calls, literal=self.compiler.literal, json_rule=json_schema_rule,
                template=self._template)
            return lark_grammar(self._format.call_grammar(forced)), "tool_choice"
        fmt = req.response_format
        if fmt is None:
            return None
        kind = fmt["type"]
        if kind == "json_object":
            return json_schema_grammar({"type": "object"}), "response_format"
        if kind == "json_schema":
            return json_schema_grammar(fmt["json_schema"]["schema"]), "response_format.json_schema.schema"
        if kind == "regex":
            return regex_grammar(fmt["regex"]), "response_format.regex"
        try:
            return lark_grammar(fmt["grammar"]), "response_format.grammar"
        except GrammarCompileError as exc:
            raise RequestError("response_format.grammar", str(exc)) from None

    def constraint(self, req: GenerationRequest, in_reasoning: bool = False) -> TokenConstraint | None:
        """The request's grammar matcher, compiled (or copied from the cache), or None.

        ``in_reasoning``: the chat prompt ended inside ``<think>``; the grammar then starts
        after ``</think>`` (also when the answer opens with ``<think>``), provided the
        vocabulary spells ``</think>`` as one token.

        Raises:
            RequestError: naming the field whose grammar does not compile: a regex or grammar
                with a syntax error; UnsupportedRequestError for a valid JSON schema that
                uses a feature the grammar library does not implement (its message names it).
        """
        found = self.grammar(req)
        if found is None:
            return None
        definition, field = found
        try:
            compiled = self.compiler.compile(definition)
        except GrammarCompileError as exc:
            if field == "response_format.json_schema.schema":
                raise UnsupportedRequestError(field, f"zllm's grammar library (llguidance) cannot enforce this "
                                                     f"schema: {_first_line(exc)}") from None
            raise RequestError(field, f"does not compile: {exc}") from None
        matcher = compiled.matcher()
        if req.messages is None or self._think_end is None:
            return matcher
        return AfterReasoning(matcher, self._think_end, self._think_start, in_reasoning)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

