"""The Request JSON contract: validation names the field, unset fields come from the config."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.runtime.sampler import TokenLogprob
from zllm.spec.config import GenerationDefaults
from zllm.spec.errors import ConfigError, RequestError
from zllm.spec.request import (
    GenerationRequest,
    make_delta_event,
    make_final_event,
    make_logprobs,
    make_response,
    parse_request,
)

DEFAULTS = GenerationDefaults()


# --- defaults merge ---------------------------------------------------------------------


def test_absent_fields_take_the_config_defaults() -> None:
    custom = GenerationDefaults(
        max_new_tokens=7, temperature=0.5, top_p=0.8, top_k=20, min_p=0.1, repetition_penalty=1.1,
        presence_penalty=0.3, frequency_penalty=-0.3, seed=11, stop=["END"], stop_token_ids=[2], add_bos=False,
    )
    req = parse_request({"prompt": "hi"}, custom)
    assert req == GenerationRequest(
        prompt="hi", max_tokens=7, temperature=0.5, top_p=0.8, top_k=20, min_p=0.1, repetition_penalty=1.1,
        presence_penalty=0.3, frequency_penalty=-0.3, seed=11, stop=("END",), stop_token_ids=(2,), add_bos=False,
    )


def test_null_means_default_and_given_fields_win() -> None:
    custom = GenerationDefaults(temperature=0.5, seed=3, max_new_tokens=9)
    req = parse_request({"prompt": "x", "temperature": None, "seed": 4, "max_tokens": None, "top_k": 5}, custom)
    assert (req.temperature, req.seed, req.max_tokens, req.top_k) == (0.5, 4, 9, 5)


def test_config_prompt_is_not_a_request_default() -> None:
    # A request without a prompt is a client bug; silently running the configured prompt would hide it.
    with pytest.raises(RequestError) as exc:
        parse_request({}, GenerationDefaults(prompt="Once upon a time"))
    assert exc.value.field == "prompt"


def test_normalisation() -> None:
    req = parse_request(
        {"prompt_token_ids": [1, 2, 3], "stop": "\n", "temperature": 1, "stop_token_ids": [0]}, DEFAULTS
    )
    assert req.prompt is None and req.prompt_token_ids == (1, 2, 3)
    assert req.stop == ("\n",) and req.stop_token_ids == (0,)
    assert req.temperature == 1.0 and isinstance(req.temperature, float)
    assert parse_request({"prompt": "", "stop": ["a", "b"]}, DEFAULTS).stop == ("a", "b")
    assert hash(req)  # frozen and hashable: tuples, not lists


def test_add_special_tokens_is_an_alias_of_add_bos() -> None:
    assert parse_request({"prompt": "x", "add_special_tokens": False}, DEFAULTS).add_bos is False
    with pytest.raises(RequestError) as exc:
        parse_request({"prompt": "x", "add_special_tokens": False, "add_bos": True}, DEFAULTS)
    assert exc.value.field == "add_special_tokens"


# --- errors name the field ----------------------------------------------------------------

BAD_FIELDS = [
    # (field, value, message after "<field>: ")
    ("prompt", 5, "expected a string or null, got 5"),
    ("prompt_token_ids", [], "expected a non-empty list of token ids (ints >= 0) or null, got []"),
    ("prompt_token_ids", [1, -1], "expected a non-empty list of token ids (ints >= 0) or null, got [1, -1]"),
    ("prompt_token_ids", [1, True], "expected a non-empty list of token ids (ints >= 0) or null, got [1, True]"),
    ("prompt_token_ids", "1 2", "expected a non-empty list of token ids (ints >= 0) or null, got '1 2'"),
    ("max_tokens", 0, "expected a positive int, got 0"),
    ("max_tokens", True, "expected a positive int, got True"),
    ("max_tokens", 3.0, "expected a positive int, got 3.0"),
    ("temperature", -1, "expected a number >= 0 (0 = greedy), got -1.0"),
    ("temperature", False, "expected a number >= 0 (0 = greedy), got False"),
    ("temperature", "0.7", "expected a number >= 0 (0 = greedy), got '0.7'"),
    ("temperature", math.inf, "expected a number >= 0 (0 = greedy), got inf"),
    ("top_p", 0, "expected a number in (0, 1], got 0.0"),
    ("top_p", 1.01, "expected a number in (0, 1], got 1.01"),
    ("top_k", -2, "expected an int >= -1 (0 or -1 disables), got -2"),
    ("top_k", True, "expected an int >= -1 (0 or -1 disables), got True"),
    ("min_p", -0.1, "expected a number in [0, 1], got -0.1"),
    ("repetition_penalty", 0, "expected a number > 0, got 0.0"),
    ("presence_penalty", 2.1, "expected a number in [-2, 2], got 2.1"),
    ("frequency_penalty", -2.1, "expected a number in [-2, 2], got -2.1"),
    ("seed", "42", "expected an int in [0, 2**64) or null, got '42'"),
    ("seed", True, "expected an int in [0, 2**64) or null, got True"),
    ("stop", "", "expected a non-empty string or a list of at most 16 non-empty strings, got ''"),
    ("stop", [1], "expected a non-empty string or a list of at most 16 non-empty strings, got [1]"),
    ("stop", {"a": 1}, "expected a non-empty string or a list of at most 16 non-empty strings, got {'a': 1}"),
    ("stop", ["s"] * 17,
     "expected a non-empty string or a list of at most 16 non-empty strings, "
     "got ['s', 's', 's', 's', 's', 's', 's', 's', ...]"),
    ("stop_token_ids", [1.0], "expected a list of token ids (ints >= 0), got [1.0]"),
    ("add_bos", 1, "expected true, false or null, got 1"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_FIELDS, ids=[f"{f}={v!r}"[:50] for f, v, _ in BAD_FIELDS])
def test_bad_field_is_named(field: str, value: Any, message: str) -> None:
    base = {"prompt": "x"} if field not in ("prompt", "prompt_token_ids") else {}
    with pytest.raises(RequestError) as exc:
        parse_request({**base, field: value}, DEFAULTS)
    assert exc.value.field == field
    assert str(exc.value) == f"{field}: {message}"


@pytest.mark.parametrize(
    ("field", "suggestion"),
    [("temprature", "temperature"), ("max_token", "max_tokens"), ("stop_tokens_ids", "stop_token_ids"),
     ("promt", "prompt")],
)
def test_unknown_field_suggests_the_close_one(field: str, suggestion: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request({"prompt": "x", field: 1}, DEFAULTS)
    assert exc.value.field == field
    assert f"unknown field {field!r}; did you mean {suggestion!r}?" in str(exc.value)
    assert "valid fields: add_bos, add_special_tokens, frequency_penalty" in str(exc.value)


def test_stream_is_not_a_request_field() -> None:
    with pytest.raises(RequestError) as exc:
        parse_request({"prompt": "x", "stream": True}, DEFAULTS)
    assert exc.value.field == "stream"


@pytest.mark.parametrize(
    ("data", "given"),
    [({}, "neither was given"), ({"prompt": "a", "prompt_token_ids": [1]}, "both were given")],
)
def test_exactly_one_prompt_kind(data: dict[str, Any], given: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(data, DEFAULTS)
    assert exc.value.field == "prompt"
    assert given in str(exc.value)


def test_non_object_request() -> None:
    with pytest.raises(RequestError, match="expected a JSON object, got list"):
        parse_request(["prompt"], DEFAULTS)  # type: ignore[arg-type]


def test_direct_construction_and_evolve_validate() -> None:
    req = parse_request({"prompt": "x"}, DEFAULTS)
    with pytest.raises(RequestError) as exc:
        attrs.evolve(req, top_p=2.0)
    assert exc.value.field == "top_p"
    with pytest.raises(RequestError) as exc:
        attrs.evolve(req, prompt_token_ids=(1,))
    assert exc.value.field == "prompt"


# --- one rule set: the request and the config's defaults accept the same values ----------

# Request field -> GenerationDefaults key.
_SHARED = {
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed", "stop_token_ids": "stop_token_ids",
    "add_bos": "add_bos",
}
_any_value = (
    st.booleans() | st.integers(-5, 5) | st.integers() | st.floats() | st.text(max_size=3)
    | st.lists(st.integers(-2, 3) | st.booleans(), max_size=3)
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(_SHARED)), value=_any_value)
def test_request_and_config_share_every_rule(field: str, value: Any) -> None:
    try:
        GenerationDefaults(**{_SHARED[field]: value})
        config_ok = True
    except ConfigError as exc:
        assert exc.path == f"generation.{_SHARED[field]}"
        config_ok = False
    try:
        parse_request({"prompt": "x", field: value}, DEFAULTS)
        request_ok = True
    except RequestError as exc:
        assert exc.field == field
        request_ok = False
    assert config_ok == request_ok


# --- property: valid requests parse to exactly what was asked ----------------------------

_valid_request = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 10**6),
        "temperature": st.floats(0, 100),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(-1, 10**5),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.01, 10),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=16),
        "stop_token_ids": st.lists(st.integers(0, 2**31), max_size=4),
        "add_bos": st.booleans(),
    },
)


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.one_of(
        st.fixed_dictionaries({"prompt": st.text(max_size=10)}),
        st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 2**31), min_size=1, max_size=8)}),
    ),
    fields=_valid_request,
)
def test_valid_requests_parse_to_what_was_asked(prompt: dict[str, Any], fields: dict[str, Any]) -> None:
    req = parse_request({**prompt, **fields}, DEFAULTS)
    got = attrs.asdict(req)
    asked = {**prompt, **fields}
    if isinstance(asked.get("stop"), str):
        asked["stop"] = [asked["stop"]]
    for name, value in asked.items():
        assert got[name] == (tuple(value) if isinstance(value, list) else value)
    defaulted = {**_SHARED, "stop": "stop"}
    for name in set(defaulted) - set(fields):
        assert got[name] == getattr(DEFAULTS, defaulted[name])


# --- responses and stream events ----------------------------------------------------------


def test_make_response() -> None:
    resp = make_response("Hello", (9, 10), "length", prompt_tokens=4, completion_tokens=2, cached_tokens=3)
    assert resp == {
        "text": "Hello",
        "token_ids": [9, 10],
        "finish_reason": "length",
        "stop_sequence": None,
        "content": "Hello",
        "reasoning_content": "",
        "tool_calls": [],
        "logprobs": None,
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "cached_tokens": 3},
    }
    assert json.loads(json.dumps(resp)) == resp


def test_make_logprobs_gives_each_token_its_text_and_alternatives() -> None:
    entries = [TokenLogprob(9, -0.25, ((9, -0.25), (4, -1.5))), TokenLogprob(10, -9999.0, ())]
    out = make_logprobs(entries, {4: "a", 9: "He", 10: "llo"}.__getitem__)
    assert out == [{"token_id": 9, "token": "He", "logprob": -0.25,
                    "top_logprobs": [{"token_id": 9, "token": "He", "logprob": -0.25},
                                     {"token_id": 4, "token": "a", "logprob": -1.5}]},
                   {"token_id": 10, "token": "llo", "logprob": -9999.0, "top_logprobs": []}]
    resp = make_response("Hello", (9, 10), "length", 1, 2, 0, logprobs=out)
    assert json.loads(json.dumps(resp, allow_nan=False))["logprobs"] == out


@pytest.mark.parametrize(("value", "ok"), [(None, True), (0, True), (20, True), (21, False), (-1, False),
                                           (True, False), (1.0, False)])
def test_logprobs_field_is_an_int_from_0_to_20(value, ok) -> None:
    if ok:
        assert parse_request({"prompt": "x", "logprobs": value}, GenerationDefaults()).logprobs == value
    else:
        with pytest.raises(RequestError, match=r"^logprobs: .*an int in \[0, 20\]"):
            parse_request({"prompt": "x", "logprobs": value}, GenerationDefaults())


def test_stream_events() -> None:
    deltas = [make_delta_event("Hel", [1]), make_delta_event("", [2]), make_delta_event("lo", (3,))]
    final = make_final_event("stop", prompt_tokens=2, completion_tokens=3, cached_tokens=0, content="Hello")
    assert all(d["type"] == "delta" for d in deltas) and deltas[2]["token_ids"] == [3]
    assert "".join(d["text"] for d in deltas) == "Hello" == "".join(d["content"] for d in deltas)
    assert final == {
        "type": "final",
        "finish_reason": "stop",
        "stop_sequence": None,
        "content": "Hello",
        "reasoning_content": "",
        "tool_calls": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "cached_tokens": 0},
    }
    assert json.loads(json.dumps([*deltas, final])) == [*deltas, final]


def test_the_stop_string_that_ended_generation_is_in_the_result_and_the_final_event() -> None:
    resp = make_response("Hel", (9,), "stop", 1, 1, 0, stop_sequence="lo")
    final = make_final_event("stop", 1, 1, 0, content="Hel", stop_sequence="lo")
    assert resp["stop_sequence"] == final["stop_sequence"] == "lo"


def test_a_schema_seen_before_is_judged_as_the_first_time():
    from zllm.spec.request import check_json_schema

    bad = {"type": "object", "properties": {"n": {"type": "integr"}}}
    for _ in range(2):  # the second answer comes from the cache of checked schemas
        with pytest.raises(RequestError, match=r"is not a valid JSON schema") as info:
            check_json_schema(bad, "response_format.json_schema.schema")
        assert info.value.field == "response_format.json_schema.schema.properties.n.type"
    check_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}, "x")
