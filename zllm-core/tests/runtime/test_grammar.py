"""Grammar matchers (llguidance) over real vocabularies: what a grammar allows is all a
sequence can produce, EOS only where the grammar may end, padded logits columns never.

The model is stood in for by a seeded random walk through the masks (grammar_walk.py): any
walk is a generation some model could make, so a property over walks is a property of
constrained decoding itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.grammar_walk import closer_weights, json_schemas, walk
from zllm.runtime.grammar import (
    AfterReasoning,
    GrammarCompileError,
    GrammarCompiler,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from zllm.runtime.sampler import unpack_bitmask
from zllm.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[3] / "assets" / "models" / "stories260k"
PADDED = 520  # stories260K has 512 tokens; a padded logits width that is not a multiple of 32


@pytest.fixture(scope="module", params=["hf", "gguf"])
def stories(request):
    """stories260K's SentencePiece vocabulary from its tokenizer.json and from its GGUF file
    (a GGUF-only model builds the grammar library's token table from the GGUF vocabulary)."""
    if request.param == "hf":
        config = json.loads((ASSETS / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok = Tokenizer.from_hf_files(ASSETS / "hf" / "tokenizer.json", config)
    else:
        tok = Tokenizer.from_gguf_file(next((ASSETS / "gguf").glob("*f32*.gguf")))
    eos = frozenset(tok.eos_token_ids)
    return tok, GrammarCompiler(tok, PADDED, eos), closer_weights(tok, PADDED), eos


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas(), seed=st.integers(0, 2**32 - 1))
def test_every_walk_under_a_json_schema_is_json_valid_under_it(stories, schema, seed):
    tok, compiler, weights, eos = stories
    matcher = compiler.compile(json_schema_grammar(schema)).matcher()
    text = walk(matcher, tok, PADDED, weights, seed, eos=eos)
    jsonschema.validate(json.loads(text), schema)
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), f"compact JSON has no whitespace between tokens: {text!r}"


def test_a_regex_allows_eos_only_where_the_text_may_end(stories):
    tok, compiler, _, eos = stories
    matcher = compiler.compile(regex_grammar("(ab)+")).matcher()
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    assert not any(bool(unpack_bitmask(matcher.allowed_tokens(), PADDED)[e]) for e in eos)
    for token, may_end in ((a, False), (b, True), (a, False), (b, True)):
        matcher.accept(token)
        allowed = unpack_bitmask(matcher.allowed_tokens(), PADDED)
        assert all(bool(allowed[e]) == may_end for e in eos)
    assert not matcher.finished  # (ab)+ may always go on


def test_padded_logits_columns_are_never_allowed(stories):
    _, compiler, _, _ = stories
    matcher = compiler.compile(json_schema_grammar({"type": "string"})).matcher()
    mask = matcher.allowed_tokens()
    assert mask.dtype == torch.int32 and mask.shape == ((PADDED + 31) // 32,)
    matcher.accept(compiler.token_table().tokenize_str('"')[0])
    assert not unpack_bitmask(matcher.allowed_tokens(), PADDED)[512:].any()


def test_a_finished_grammar_ends_the_sequence_without_an_eos(stories):
    tok, compiler, weights, eos = stories
    matcher = compiler.compile(lark_grammar('root ::= "yes" | "no"')).matcher()
    text = walk(matcher, tok, PADDED, weights, 0, eos=frozenset())  # no EOS may be drawn: the grammar ends it
    assert text in ("yes", "no") and matcher.finished


def test_compiled_grammars_are_cached_and_matchers_are_independent(stories):
    tok, compiler, weights, eos = stories
    definition = json_schema_grammar({"enum": ["left", "right"]})
    compiled = compiler.compile(definition)
    assert compiler.compile(definition) is compiled
    first, second = compiled.matcher(), compiled.matcher()
    first.accept(compiler.token_table().tokenize_str('"')[0])
    assert not torch.equal(first.allowed_tokens().clone(), second.allowed_tokens())
    assert walk(second, tok, PADDED, weights, 1, eos=eos) in ('"left"', '"right"')


@pytest.mark.parametrize(("definition", "message"), [
    (lambda: json_schema_grammar({"type": "object", "not": {"type": "string"}}), "not"),
    (lambda: regex_grammar("a(b"), "unclosed group"),
    (lambda: lark_grammar("start: undefined_rule"), "undefined_rule"),
])
def test_a_grammar_that_does_not_compile_names_the_construct(stories, definition, message):
    _, compiler, _, _ = stories
    with pytest.raises(GrammarCompileError, match=message):
        compiler.compile(definition())


def test_gbnf_that_does_not_convert_is_a_compile_error():
    with pytest.raises(GrammarCompileError, match="neither Lark nor GBNF"):
        lark_grammar('root ::= "a" (')


def test_after_reasoning_the_grammar_starts_at_the_closing_think_token(stories):
    tok, compiler, _, _ = stories
    think, end_think = tok.token_to_id("a"), tok.token_to_id("b")  # stand-ins: any two single tokens
    digit = tok.token_to_id("3")
    gate = AfterReasoning(compiler.compile(regex_grammar("[0-9]")).matcher(), end_think, think, in_reasoning=False)
    first = unpack_bitmask(gate.allowed_tokens(), PADDED)
    assert first[think] and first[digit] and not first[end_think]  # answer now, or open the reasoning
    gate.accept(think)
    assert gate.allowed_tokens() is None  # reasoning is free text
    gate.accept(tok.token_to_id("c"))
    gate.accept(end_think)
    after = unpack_bitmask(gate.allowed_tokens(), PADDED)
    assert after[digit] and not after[think] and not gate.finished
    gate.accept(digit)
    assert gate.finished
