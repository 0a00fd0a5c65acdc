"""Forced tool calls (``tool_choice`` ``required`` or a named tool) on all three protocols.

Two checkpoints (tests/server/conftest.py): ``random_tool_chat`` has random weights and
Qwen2.5's tool template, so any call it makes comes from the grammar, and must still be a
valid call whose arguments validate against the tool's schema (``jsonschema``); ``tool_chat``
always answers with a ``get_weather`` call, so forcing ``get_time`` shows the choice is
enforced, not hoped for.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import TIME_TOOL
from tests.server.test_tool_calls import TOOLS, USER

# Bounded schemas: a random walk through them ends well within max_tokens.
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look up a city.", "parameters": {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm.", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                     "loud": {"type": "boolean"}},
    "required": ["hour", "loud"], "additionalProperties": False}}}
RANDOM_TOOLS = [LOOKUP, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in RANDOM_TOOLS}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in RANDOM_TOOLS]


@pytest.fixture(scope="module")
def oai(random_tool_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{random_tool_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(random_tool_chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=random_tool_chat_server.url, api_key="unused", max_retries=0, timeout=120)


def valid_call(name: str, arguments: str | dict) -> None:
    assert name in SCHEMAS, name
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


# ------------------------------------------------------------------ OpenAI Chat


@pytest.mark.parametrize("seed", range(3))
def test_chat_required_makes_a_valid_call_from_a_random_model(oai, random_tool_chat_server, seed):
    out = oai.chat.completions.create(model=random_tool_chat_server.model, messages=USER, tools=RANDOM_TOOLS,
                                      tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed,
                                      max_completion_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    valid_call(call.function.name, call.function.arguments)


def test_chat_required_with_parallel_calls_makes_only_valid_calls(oai, random_tool_chat_server):
    out = oai.chat.completions.create(model=random_tool_chat_server.model, messages=USER, tools=RANDOM_TOOLS,
                                      tool_choice="required", temperature=1.0, seed=11, max_completion_tokens=400)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
    for call in calls:
        valid_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("name", ["lookup", "set_alarm"])
def test_chat_named_tool_is_the_one_called(oai, random_tool_chat_server, name):
    out = oai.chat.completions.create(model=random_tool_chat_server.model, messages=USER, tools=RANDOM_TOOLS,
                                      tool_choice={"type": "function", "function": {"name": name}},
                                      parallel_tool_calls=False, temperature=1.0, seed=2, max_completion_tokens=200)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == name
    valid_call(name, call.function.arguments)


def test_chat_forced_call_streams_as_tool_call_deltas(oai, random_tool_chat_server):
    kw = dict(model=random_tool_chat_server.model, messages=USER, tools=RANDOM_TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, seed=4, max_completion_tokens=200)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == whole.function.name
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_n_forced_choices_each_call(oai, random_tool_chat_server):
    out = oai.chat.completions.create(model=random_tool_chat_server.model, messages=USER, tools=RANDOM_TOOLS,
                                      tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=21,
                                      n=3, max_completion_tokens=200)
    for choice in out.choices:
        [call] = choice.message.tool_calls
        valid_call(call.function.name, call.function.arguments)


def test_forcing_overrides_what_the_model_would_call(tool_chat_server):
    # tool_chat calls get_weather whenever it may; forced to get_time, it calls get_time.
    # (No extra properties: tool_chat's logits beyond its fixed answer are all zero, and greedy
    # decoding would spell one property name forever.)
    time_tool = {"type": "function", "function": {**TIME_TOOL["function"], "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    client = openai.OpenAI(base_url=f"{tool_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    free = client.chat.completions.create(model=tool_chat_server.model, messages=USER, tools=[TOOLS[0], time_tool],
                                          parallel_tool_calls=False, temperature=0, max_completion_tokens=64)
    assert free.choices[0].message.tool_calls[0].function.name == "get_weather"
    out = client.chat.completions.create(model=tool_chat_server.model, messages=USER, tools=[TOOLS[0], time_tool],
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         parallel_tool_calls=False, temperature=0, max_completion_tokens=64)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


# ------------------------------------------------------------------ Responses and Anthropic


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "set_alarm"}])
def test_responses_forced_call(oai, random_tool_chat_server, choice):
    tools = [{"type": "function", **t["function"]} for t in RANDOM_TOOLS]
    out = oai.responses.create(model=random_tool_chat_server.model, input=USER, tools=tools, tool_choice=choice,
                               parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
                               extra_body={"seed": 6})
    [call] = [o for o in out.output if o.type == "function_call"]
    if isinstance(choice, dict):
        assert call.name == choice["name"]
    valid_call(call.name, call.arguments)
    assert out.tool_choice == choice or out.tool_choice.name == choice["name"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "lookup"}])
def test_anthropic_forced_tool_use(claude, random_tool_chat_server, choice):
    out = claude.messages.create(model=random_tool_chat_server.model, max_tokens=200, messages=USER,
                                 tools=ANTHROPIC_TOOLS, tool_choice={**choice, "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 1.0})
    assert out.stop_reason == "tool_use"
    [block] = [b for b in out.content if b.type == "tool_use"]
    if choice["type"] == "tool":
        assert block.name == "lookup"
    valid_call(block.name, block.input)


def test_anthropic_forced_tool_use_streams_input_json(claude, random_tool_chat_server):
    with claude.messages.stream(model=random_tool_chat_server.model, max_tokens=200, messages=USER,
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "set_alarm",
                                                                    "disable_parallel_tool_use": True}) as s:
        final = s.get_final_message()
    [block] = [b for b in final.content if b.type == "tool_use"]
    assert block.name == "set_alarm" and final.stop_reason == "tool_use"
    valid_call(block.name, block.input)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # no tools
    ("/v1/chat/completions", {"tools": RANDOM_TOOLS, "tool_choice": {"type": "function",
                                                                     "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": RANDOM_TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/responses", {"tools": [{"type": "function", **LOOKUP["function"]}],
                       "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "bad name", "parameters": {}}]}, "tools[0].name"),
])
def test_bad_forced_tool_requests_are_400_naming_the_field(random_tool_chat_server, path, body, param):
    prompt = {"messages": USER, "max_tokens": 4} if path == "/v1/chat/completions" else \
        {"input": USER, "max_output_tokens": 4}
    r = httpx.post(random_tool_chat_server.url + path, json={**prompt, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert random_tool_chat_server.healthy()


def test_forcing_a_call_on_a_model_without_a_tool_format_is_400(tiny_chat_server):
    r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "max_tokens": 4, "tools": RANDOM_TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("tools", "tool_choice"), r.text


def test_anthropic_tool_choice_naming_an_unknown_tool_is_400(random_tool_chat_server):
    r = httpx.post(random_tool_chat_server.url + "/v1/messages", timeout=30, json={
        "model": random_tool_chat_server.model, "max_tokens": 4, "messages": USER, "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "nope"}})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "tool_choice" in r.json()["error"]["message"] and "nope" in r.json()["error"]["message"]
