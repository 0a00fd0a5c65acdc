"""Grammar-constrained decoding: token masks from llguidance, one matcher per sequence.

A grammar (a JSON schema, a Lark or GBNF grammar, a regular expression) is compiled once per
model by :class:`GrammarCompiler` — in the caller's thread, never on the engine loop's, and
cached by its definition — and each constrained sequence gets a :class:`GrammarMatcher`
copied from the compiled one. Before a constrained token is sampled the matcher fills a
packed int32 bitmask ``[ceil(V / 32)]`` of the tokens the grammar allows next
(:func:`zllm.runtime.sampler.apply_masks` applies it), and every accepted token advances
it. ``V`` is the width tokens are sampled from; a wider one (a padded vocabulary's extra
columns) is allowed no column past the tokenizer's vocabulary. The end-of-sequence ids
are allowed exactly where the grammar may end; once it cannot continue, the sequence
finishes without sampling one (:attr:`GrammarMatcher.finished`).

Why llguidance rather than xgrammar (both are well-kept and fast; vLLM and SGLang ship
both): llguidance has no Python dependencies, while xgrammar needs torch, transformers,
triton and apache-tvm-ffi at run time — transformers would become a runtime dependency of
the core. llguidance reads Lark, GBNF (llama.cpp's grammars), JSON schemas and regular
expressions through one compiler, and builds its token table from the ``tokenizers`` JSON
that both of zllm's tokenizer sources (HF files and GGUF vocabularies) become. Its cost per
token is measured by ``bench/grammar.py``.

JSON schemas compile to compact JSON (no whitespace between tokens) unless the schema says
otherwise in llguidance's ``x-guidance`` key (``{"whitespace_flexible": true}``): free
whitespace lets a weak model fill ``max_tokens`` with newlines, which is the usual failure
of grammar-constrained JSON.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only

from zllm.tokenizer import Tokenizer

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
"""llguidance JSON-compiler options every schema starts from (module doc)."""

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per model (least recently used dropped first)."""


class GrammarCompileError(ValueError):
    """A grammar definition that llguidance cannot compile; the message is llguidance's,
    naming the construct (an unsupported schema keyword, a bad regex, a Lark syntax error)."""


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The llguidance grammar definition of JSON text valid under ``schema`` (a JSON schema
    object; compact JSON unless its ``x-guidance`` says otherwise)."""
    return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_DEFAULTS)


def regex_grammar(pattern: str) -> str:
    """The llguidance grammar definition of text matching ``pattern`` as a whole (Rust
    ``regex`` syntax, https://docs.rs/regex)."""
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str) -> str:
    """The llguidance grammar definition of a Lark grammar (llguidance's dialect:
    ``%json {schema}`` embeds a JSON schema, ``<[id]>`` a token by id) or a GBNF grammar as
    llama.cpp writes it (``root ::= ...``), told apart as llguidance's converter does.

    Raises:
        GrammarCompileError: GBNF that does not convert.
    """
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions for bad GBNF
        raise GrammarCompileError(f"the grammar is neither Lark nor GBNF: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def json_schema_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body that embeds ``schema`` with the module's JSON defaults, for grammars
    that put JSON inside other text (tool calls)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}})


class GrammarMatcher:
    """One sequence's position in a grammar (:class:`zllm.runtime.sequence.TokenConstraint`).

    Built by :meth:`CompiledGrammar.matcher`; used only by the engine loop's thread.
    """

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int):
        self._matcher = matcher
        self._mask = torch.empty(mask_words, dtype=torch.int32)  # int32 [W], reused for every token

    def allowed_tokens(self) -> torch.Tensor:
        """The packed int32 bitmask ``[W]`` of tokens the grammar allows next (bit ``j`` of
        word ``i`` = token ``32 i + j``), on the CPU; overwritten by the next call."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), self._mask.numel() * 4)
        return self._mask

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token.

        Raises:
            RuntimeError: the grammar did not allow ``token_id`` (a masking bug, not a user
                error: sampled tokens come from the mask).
        """
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"token {token_id} is outside the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Whether the grammar allows no further token (its text is complete)."""
        return self._matcher.is_stopped()

    def fork(self) -> GrammarMatcher:
        """A copy at the same position with its own mask buffer."""
        return GrammarMatcher(self._matcher.deep_copy(), self._mask.numel())


class CompiledGrammar:
    """A grammar compiled for one tokenizer; :meth:`matcher` starts a sequence on it."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int):
        self._pristine = matcher
        self._words = mask_words
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (a copy: compiling is not repeated)."""
        with self._lock:  # deep_copy reads the pristine matcher; requests on other threads share it
            return GrammarMatcher(self._pristine.deep_copy(), self._words)


class GrammarCompiler:
    """Compiles llguidance grammar definitions for one model and caches them.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the width ``V`` of the logits tokens are sampled from.
        eos_token_ids: the ids that end a sequence; the grammar allows them where it may end.

    Thread-safe. The token table is built on first use (about a second for a 150k-token
    vocabulary), so models that never see a grammar never pay for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._token_table: llguidance.LLTokenizer | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_table(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, from the tokenizer's JSON)."""
        with self._lock:
            if self._token_table is None:
                # No EOS ids (a vocabulary without one): llguidance takes the tokenizer's own.
                self._token_table = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self._vocab_size, eos_token=self._eos or None)
            return self._token_table

    def compile(self, grammar: str) -> CompiledGrammar:
        """The compiled form of a grammar definition (from :func:`json_schema_grammar`,
        :func:`regex_grammar` or :func:`lark_grammar`), from the cache when it was compiled
        before.

        Raises:
            GrammarCompileError: llguidance rejects it (its message names the construct).
        """
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        table = self.token_table()
        # Compiling drops the GIL and may take a while for large grammars: outside the lock.
        matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        compiled = CompiledGrammar(matcher, (self._vocab_size + 31) // 32)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def special_token(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token of the vocabulary (grammars must
        name such tokens by id: llguidance never matches them against literal text)."""
        token_id = self._tokenizer.token_to_id(text)
        return token_id if token_id is not None and token_id in self._tokenizer.special_token_ids else None

    def literal(self, text: str) -> str:
        """A Lark expression matching ``text``: a special token by id, else a quoted string."""
        token_id = self.special_token(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


class AfterReasoning:
    """A constraint that starts after a reasoning section (``<think>…</think>``) ends: the
    grammar applies to the answer, never to the reasoning (a :class:`TokenConstraint`).

    Args:
        inner: the grammar's matcher.
        think_end: the id of the one token that closes reasoning.
        think_start: the id of the one token that opens it, or None; when the prompt did not
            open reasoning, the first token may still be it (then the grammar waits for
            ``think_end``) or an answer token the grammar allows.
        in_reasoning: the prompt ended inside reasoning.
    """

    def __init__(self, inner: GrammarMatcher, think_end: int, think_start: int | None, in_reasoning: bool):
        self._inner = inner
        self._end, self._start = think_end, think_start
        self._reasoning = in_reasoning
        self._first = True

    def allowed_tokens(self) -> torch.Tensor | None:
        if self._reasoning:
            return None
        mask = self._inner.allowed_tokens()
        if self._first and self._start is not None:
            word, bit = divmod(self._start, 32)
            mask[word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 is int32's sign bit
        return mask

    def accept(self, token_id: int) -> None:
        first, self._first = self._first, False
        if self._reasoning:
            self._reasoning = token_id != self._end
        elif first and token_id == self._start:
            self._reasoning = True
        else:
            self._inner.accept(token_id)

    @property
    def finished(self) -> bool:
        return not self._reasoning and self._inner.finished

    def fork(self) -> AfterReasoning:
        copy = AfterReasoning(self._inner.fork(), self._end, self._start, self._reasoning)
        copy._first = self._first
        return copy
