"""Structured output through ``zllm.Engine`` on real checkpoints: every answer under a
``response_format`` parses and validates, sampled or greedy, streamed or not, from HF files
and from a GGUF-only model; constrained and free requests share steps without changing the
free ones' tokens; a forced tool call from a random-weight model is a valid call.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zllm
from tests.conftest import CONFIGS, write_config
from tests.grammar_walk import json_schemas
from zllm.spec.errors import RequestError, UnsupportedRequestError

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "bird"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                      "maxItems": 2}},
    "required": ["name", "age", "pet"], "additionalProperties": False}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module", params=["stories260k-hf.yaml", "stories260k-gguf-q8_0.yaml"])
def engine(request):
    with zllm.Engine.from_config(CONFIGS / request.param) as e:
        yield e


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas(), seed=st.integers(0, 2**31))
def test_sampled_answers_validate_against_any_schema(engine, schema, seed):
    out = engine.generate({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0, "seed": seed,
                           "response_format": schema_format(schema)})
    assert out["finish_reason"] == "stop", out["text"]
    jsonschema.validate(json.loads(out["text"]), schema)


def test_greedy_and_streamed_answers_are_the_same_valid_json(engine):
    req = {"prompt": "The little dog", "max_tokens": 120, "response_format": schema_format(PERSON)}
    whole = engine.generate(req)
    streamed = "".join(e["text"] for e in engine.generate_stream(req) if e["type"] == "delta")
    assert streamed == whole["text"]
    jsonschema.validate(json.loads(whole["text"]), PERSON)


@pytest.mark.parametrize(("response_format", "check"), [
    ({"type": "json_object"}, lambda text: text.startswith("{")),  # unbounded: max_tokens may cut it
    ({"type": "regex", "regex": "(yes|no), [a-z]{2,8}\\."}, lambda text: text.split(", ")[0] in ("yes", "no")),
    ({"type": "grammar", "grammar": 'root ::= "Tim" | "Lily" " and " ("Tom" | "Sue")'},
     lambda text: text in ("Tim", "Lily and Tom", "Lily and Sue")),
    ({"type": "grammar", "grammar": 'start: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/'},
     lambda text: all(p.isdigit() for p in text.split("+"))),
])
def test_each_response_format_type_constrains_the_text(engine, response_format, check):
    for seed in range(3):
        out = engine.generate({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                               "response_format": response_format})
        assert check(out["text"]), out["text"]
        if out["finish_reason"] == "stop" and response_format["type"] == "json_object":
            assert isinstance(json.loads(out["text"]), dict)


def test_constrained_and_free_requests_share_steps_without_changing_free_tokens(engine):
    free = [{"prompt": p, "max_tokens": 24, "temperature": 0.0} for p in ("Once upon a time", "The cat sat")]
    alone = [engine.generate(r)["token_ids"] for r in free]
    constrained = [{"prompt": "Lily", "max_tokens": 120, "temperature": 1.0, "seed": s,
                    "response_format": schema_format(PERSON)} for s in range(4)]
    results: dict[int, dict] = {}

    def run(i: int, req: dict) -> None:
        results[i] = engine.generate(req)

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(free + constrained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[0]["token_ids"], results[1]["token_ids"]] == alone
    for i in range(2, 6):
        jsonschema.validate(json.loads(results[i]["text"]), PERSON)


def test_the_same_schema_compiles_once(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    req = {"prompt": "One", "max_tokens": 20, "response_format": schema_format(schema)}
    engine.generate(req)
    cached = len(engine.structured.compiler._cache)
    assert json.loads(engine.generate(req)["text"])["n"] in range(10)
    assert len(engine.structured.compiler._cache) == cached


@pytest.mark.parametrize(("response_format", "error", "field"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}, RequestError,
     "response_format.json_schema.schema.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {"type": "object"}}}},
     UnsupportedRequestError, "response_format.json_schema.schema"),
    ({"type": "regex", "regex": "a(b"}, RequestError, "response_format.regex"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, RequestError, "response_format.grammar"),
    ({"type": "xml"}, RequestError, "response_format.type"),
    ({"type": "json_schema"}, RequestError, "response_format.json_schema"),
    ({"type": "json_object", "schema": {}}, RequestError, "response_format.schema"),
])
def test_a_bad_response_format_is_an_error_naming_the_field_and_the_engine_keeps_serving(
        engine, response_format, error, field):
    with pytest.raises(error) as info:
        engine.generate({"prompt": "x", "max_tokens": 4, "response_format": response_format})
    assert info.value.field == field
    assert engine.generate({"prompt": "Once", "max_tokens": 4})["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------- forced tool calls


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def random_tool_model(tmp_path_factory):
    """A random-weight Qwen2 checkpoint (transformers saves it) with the Qwen2.5 tool template:
    left alone it writes noise, so any call it makes is the grammar's doing."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.server.conftest import QWEN25_TOOL_TEMPLATE, build_chatml_tokenizer

    dst = tmp_path_factory.mktemp("random-tools") / "qwen2-random"
    dst.mkdir()
    tok = build_chatml_tokenizer(dst)
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    tok.save_pretrained(dst)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(vocab_size=len(tok) + 6, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=eos)  # a padded vocabulary: 6 columns no token has
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(dst, safe_serialization=True)
    with zllm.Engine.from_config(write_config(tmp_path_factory.mktemp("cfg"), dst)) as e:
        yield e


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "get_time"}}, True),
])
def test_a_forced_tool_call_from_a_random_model_is_a_valid_call(random_tool_model, tool_choice, parallel):
    for seed in range(3):
        out = random_tool_model.generate({
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER, TIME],
            "tool_choice": tool_choice, "parallel_tool_calls": parallel, "max_tokens": 200, "temperature": 1.0,
            "seed": seed})
        calls = out["tool_calls"]
        if parallel and out["finish_reason"] == "length":  # it may go on calling: the last call can be cut
            calls = calls[:-1]
        else:
            assert out["finish_reason"] == "tool_calls" and (parallel or len(calls) == 1), out["text"]
        assert calls, out["text"]
        for call in calls:
            if isinstance(tool_choice, dict):
                assert call["name"] == tool_choice["function"]["name"]
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_auto_leaves_a_random_model_free(random_tool_model):
    out = random_tool_model.generate({"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
                                      "max_tokens": 12, "temperature": 0.0})
    assert out["tool_calls"] == [] and out["finish_reason"] in ("stop", "length")


def test_a_padded_vocabularys_extra_columns_are_never_sampled(random_tool_model):
    for seed in range(4):
        out = random_tool_model.generate({"prompt": "Hi", "max_tokens": 64, "temperature": 1.5, "seed": seed,
                                          "ignore_eos": True})
        assert max(out["token_ids"]) < random_tool_model.tokenizer.vocab_size
