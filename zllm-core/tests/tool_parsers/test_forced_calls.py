"""Forced tool calls: whatever decoding produces under a format's call grammar, that format's
parser reads as calls to the allowed tools, with arguments valid under their schemas.

Decoding is stood in for by seeded random walks through the grammar's masks (any walk is a
generation some model could make). Two byte-level vocabularies: one where the formats'
markers are special tokens (the grammar must name them by id, and the detokenizer must keep
them for the parser), one where they are plain text.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.grammar_walk import closer_weights, walk
from zllm.engine.structured import StructuredOutput
from zllm.engine.tool_parsers import FORMATS, make_output_parser, parse_output, resolve_format
from zllm.spec.config import GenerationDefaults
from zllm.spec.errors import RequestError
from zllm.spec.request import parse_request
from zllm.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note"}}  # no parameters: any object
TOOLS = [WEATHER, TIME, NOTE]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}

MARKERS = sorted({m for f in FORMATS for m in f.markers} | {"<think>", "</think>"})
EOS = "<eos>"
# Format variants the chat template selects.
TEMPLATES = {"mistral": ["[TOOL_CALLS]", "[TOOL_CALLS][ARGS]"],
             "deepseek_v3": ["tool▁calls▁begin ```json", "tool▁calls▁begin"]}


def _vocabulary(markers_special: bool) -> str:
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte: any marker text is expressible
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "<tool_call>\n</tool_call>",
              "commentary to=functions.get_time json", "<function=note>\n<parameter=city>\nRome\n</parameter>"] * 8
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS, *(MARKERS if markers_special else [])],
                                  initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    return bpe.to_str()


def _tokenizer(vocabulary_json: str, template: str) -> Tokenizer:
    bpe = HFTokenizer.from_str(vocabulary_json)
    return Tokenizer(bpe, source="test-vocabulary", bos_token_id=None, eos_token_ids=(bpe.token_to_id(EOS),),
                     add_bos=False, add_eos=False, chat_templates={"default": template})


@pytest.fixture(scope="module", params=[True, False], ids=["markers-special", "markers-text"])
def vocabulary(request):
    """``(tokenizers JSON, logits width, walk weights)`` of one of the two vocabularies."""
    text = _vocabulary(request.param)
    tok = _tokenizer(text, "")
    vocab = tok.vocab_size + 5  # a padded logits width
    return text, vocab, closer_weights(tok, vocab)


CASES = [(f.name, template) for f in FORMATS for template in TEMPLATES.get(f.name, [f.template_markers[0]])]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), parallel=st.booleans(),
       choice=st.sampled_from(["required", "get_weather", "get_time", "note"]))
@pytest.mark.parametrize(("fmt", "template"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_walk_under_a_forced_call_grammar_parses_as_valid_calls(vocabulary, fmt, template, seed, parallel,
                                                                    choice):
    text_json, vocab, weights = vocabulary
    tok = _tokenizer(text_json, template)
    tool_format = resolve_format(fmt, None)
    structured = StructuredOutput(tok, vocab, frozenset(tok.eos_token_ids), tool_format)
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": tool_choice,
                         "parallel_tool_calls": parallel}, GenerationDefaults())
    # max_steps: the parameterless tool takes any JSON object, which a random walk may nest deeply.
    text = walk(structured.constraint(req), tok, vocab, weights, seed, eos=frozenset(tok.eos_token_ids),
                keep_special_ids=structured.marker_ids, max_steps=4000)
    parsed = parse_output(make_output_parser(tool_format, tools=TOOLS, template=template), text)
    assert parsed.tool_calls, f"no call parsed from {text!r}"
    assert parsed.content.strip() == "", text
    if not parallel or fmt == "harmony":
        assert len(parsed.tool_calls) == 1, text
    for call in parsed.tool_calls:
        assert call.name == choice or choice == "required", text
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_forced_call_on_a_model_without_a_known_format_names_the_setting(vocabulary):
    text_json, vocab, _ = vocabulary
    tok = _tokenizer(text_json, "")
    structured = StructuredOutput(tok, vocab, frozenset(tok.eos_token_ids), None)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"},
                        GenerationDefaults())
    with pytest.raises(RequestError, match="server.tool_parser"):
        structured.constraint(req)


def test_marker_ids_are_the_special_tokens_among_the_markers(vocabulary):
    text_json, vocab, _ = vocabulary
    tok = _tokenizer(text_json, "[TOOL_CALLS]")
    structured = StructuredOutput(tok, vocab, frozenset(tok.eos_token_ids), resolve_format("mistral", None))
    expected = {tok.token_to_id(m) for m in ("[TOOL_CALLS]", "[ARGS]", "<think>", "</think>")} - {None}
    assert structured.marker_ids == (expected & tok.special_token_ids)
