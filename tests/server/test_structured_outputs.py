"""Structured outputs on every protocol against a real ``zllm serve`` of a random-weight model
(``tiny_chat``): Chat and Completions ``response_format``, Responses ``text.format``,
Anthropic ``output_config.format``, and zllm's regex and grammar formats. A random-weight
model follows no instruction, so an answer that parses and validates (``jsonschema``) is
the grammar's doing. Schemas are bounded (enums, integer ranges, ``maxLength``, no extra
properties) so a random walk through them ends well within ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
        "vaccinated": {"type": "boolean"},
        "toys": {"type": "array", "items": {"enum": ["ball", "rope"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "vaccinated", "toys"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "bird"]
    vaccinated: bool


class Checkup(BaseModel):
    # No free string: the anthropic SDK moves maxLength into a description, leaving it unbounded.
    kind: Literal["cat", "dog", "bird"]
    healthy: bool


@pytest.fixture(scope="module")
def oai(tiny_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(tiny_chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_chat_server.url, api_key="unused", max_retries=0, timeout=120)


def json_schema_format(schema: dict, name: str = "pet") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------------ OpenAI Chat and Completions


def test_chat_parse_with_a_pydantic_model(oai, tiny_chat_server):
    # The SDK sends Pet's strict JSON schema and parses message.content back into a Pet.
    out = oai.chat.completions.parse(model=tiny_chat_server.model, messages=MESSAGES, response_format=Pet,
                                     max_completion_tokens=200, temperature=1.0, seed=1)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet) and message.parsed == Pet.model_validate_json(message.content)


@pytest.mark.parametrize("seed", range(4))
def test_chat_json_schema_answers_validate(oai, tiny_chat_server, seed):
    out = oai.chat.completions.create(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=300,
                                      temperature=1.0, seed=seed, response_format=json_schema_format(PET_SCHEMA))
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PET_SCHEMA)


def test_chat_json_object_answer_is_a_json_object(oai, tiny_chat_server):
    out = oai.chat.completions.create(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=300,
                                      temperature=0.7, seed=3, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # a free-form object may run past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


def test_chat_streamed_json_schema_answer_validates_and_equals_the_whole(oai, tiny_chat_server):
    kw = dict(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=300, temperature=1.0, seed=5,
              response_format=json_schema_format(PET_SCHEMA))
    whole = oai.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PET_SCHEMA)


def test_chat_n_choices_each_validate(oai, tiny_chat_server):
    out = oai.chat.completions.create(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=300,
                                      temperature=1.0, seed=8, n=3, response_format=json_schema_format(PET_SCHEMA))
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_completions_response_format(tiny_chat_server):
    body = {"model": tiny_chat_server.model, "prompt": "A pet:", "max_tokens": 300, "temperature": 1.0, "seed": 2,
            "response_format": json_schema_format(PET_SCHEMA)}
    out = httpx.post(tiny_chat_server.url + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["choices"][0]["text"]), PET_SCHEMA)


def test_regex_extension(oai, tiny_chat_server):
    pattern = r"[a-z]{2,5}-[0-9]{3}"
    for seed in range(3):
        out = oai.chat.completions.create(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=40,
                                          temperature=1.0, seed=seed,
                                          extra_body={"response_format": {"type": "regex", "regex": pattern}})
        assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0].message.content


@pytest.mark.parametrize("grammar", [
    'start: answer\nanswer: "yes" | "no" | "maybe"',  # Lark
    'root ::= answer\nanswer ::= "yes" | "no" | "maybe"',  # GBNF
])
def test_grammar_extension(oai, tiny_chat_server, grammar):
    answers = set()
    for seed in range(4):
        out = oai.chat.completions.create(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=10,
                                          temperature=1.0, seed=seed,
                                          extra_body={"response_format": {"type": "grammar", "grammar": grammar}})
        answers.add(out.choices[0].message.content)
    assert answers <= {"yes", "no", "maybe"}


def test_text_format_is_unconstrained(oai, tiny_chat_server):
    kw = dict(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=8, temperature=0)
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    assert oai.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content == plain


# ------------------------------------------------------------------ Responses and Anthropic


def test_responses_parse_with_a_pydantic_model(oai, tiny_chat_server):
    out = oai.responses.parse(model=tiny_chat_server.model, input=MESSAGES, text_format=Pet, max_output_tokens=200,
                              temperature=1.0, extra_body={"seed": 1})
    assert out.status == "completed" and isinstance(out.output_parsed, Pet)
    assert out.text.format.type == "json_schema"


def test_responses_text_format_json_schema_streamed(oai, tiny_chat_server):
    fmt = {"type": "json_schema", "name": "pet", "schema": PET_SCHEMA, "strict": True}
    events = list(oai.responses.create(model=tiny_chat_server.model, input=MESSAGES, max_output_tokens=300,
                                       temperature=1.0, extra_body={"seed": 4}, text={"format": fmt}, stream=True))
    done = events[-1].response
    assert done.status == "completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text
    jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_anthropic_parse_with_a_pydantic_model(claude, tiny_chat_server):
    out = claude.messages.parse(model=tiny_chat_server.model, max_tokens=200, messages=MESSAGES,
                                output_format=Checkup, extra_body={"temperature": 1.0})
    assert out.stop_reason == "end_turn" and isinstance(out.parsed_output, Checkup)


def test_anthropic_output_config_format_streamed(claude, tiny_chat_server):
    with claude.messages.stream(model=tiny_chat_server.model, max_tokens=300, messages=MESSAGES,
                                output_config={"format": {"type": "json_schema", "schema": PET_SCHEMA}}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text), PET_SCHEMA)


# ------------------------------------------------------------------ hypothesis: generated schemas

_LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}),
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": lo_span[0] + lo_span[1]}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "null"}),
)


def _object(children):
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


_SCHEMAS = _object(st.recursive(_LEAF, lambda inner: st.one_of(
    _object(inner), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                              inner, st.integers(0, 2))), max_leaves=4))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, seed=st.integers(0, 2**32))
def test_generated_schemas_are_obeyed_by_a_random_model(tiny_chat_server, schema, seed):
    body = {"model": tiny_chat_server.model, "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0,
            "seed": seed, "response_format": json_schema_format(schema, "generated")}
    out = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", (schema, choice)
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


# ------------------------------------------------------------------ bad input


INVALID_SCHEMA = {"type": "object", "properties": {"a": {"type": "strnig"}}}
UNSUPPORTED_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "format": "hostname"}},
                      "patternProperties": {"^x": {"type": "string"}}, "uniqueItems": True,
                      "dependentSchemas": {"a": {"required": ["b"]}}}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"response_format": json_schema_format(INVALID_SCHEMA)},
     "response_format.json_schema.schema.properties.a.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "regex", "regex": "("}}, "response_format.regex"),
    ("/v1/chat/completions", {"response_format": {"type": "grammar", "grammar": "start: ("}},
     "response_format.grammar"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": INVALID_SCHEMA}}},
     "text.format.schema.properties.a.type"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "extra": 1}}},
     "text.format.extra"),
    ("/v1/responses", {"text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_bad_formats_are_400_naming_the_field(tiny_chat_server, path, body, param):
    prompt = {"/v1/chat/completions": {"messages": MESSAGES}, "/v1/completions": {"prompt": "A"},
              "/v1/responses": {"input": "A"}}[path]
    r = httpx.post(tiny_chat_server.url + path, json={**prompt, **body, "max_tokens" if path != "/v1/responses"
                                                      else "max_output_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert tiny_chat_server.healthy()


def test_a_schema_feature_the_library_cannot_compile_is_a_400_naming_it(tiny_chat_server):
    r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 4, "response_format": json_schema_format(UNSUPPORTED_SCHEMA)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "unsupported_parameter"
    assert "llguidance" in err["message"]


@pytest.mark.parametrize(("fmt", "needle"), [
    ({"type": "json_schema", "schema": INVALID_SCHEMA}, "output_config.format.schema.properties.a.type"),
    ({"type": "json_schema"}, "output_config.format.schema"),
    ({"type": "json_object"}, "output_config.format.type"),
    ({"type": "json_schema", "schema": {}, "name": "x"}, "output_config.format.name"),
])
def test_anthropic_bad_formats_are_400_in_its_shape(tiny_chat_server, fmt, needle):
    r = httpx.post(tiny_chat_server.url + "/v1/messages", timeout=30, json={
        "model": tiny_chat_server.model, "max_tokens": 4, "messages": MESSAGES, "output_config": {"format": fmt}})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and needle in body["error"]["message"], body
