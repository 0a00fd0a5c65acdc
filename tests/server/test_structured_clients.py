"""Structured outputs through the clients' own pydantic helpers, on a random-weight model.

The openai SDK's streaming helpers (``chat.completions.stream`` and ``responses.stream`` with
a pydantic model), nested models (the SDK's strict schema holds them in ``$defs`` and refers
to them by ``$ref``, with ``anyOf`` for an optional field), strict function tools from
``openai.pydantic_function_tool`` forced by ``tool_choice`` — each against a real
``zllm serve`` (the Agents SDK's ``output_type`` is in test_agents_sdk.py). A random-weight model follows no
instruction, so an answer the client parses into its model is the grammar's doing. Every
string, list and number is bounded so a random walk through the schema ends well within
``max_tokens`` (and tiny_chat's 256 positions).
"""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Write down an order as JSON."}]


class Customer(BaseModel):
    name: str = Field(max_length=8)
    vip: bool


class Item(BaseModel):
    fruit: Literal["apple", "pear", "plum"]
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    customer: Customer
    items: list[Item] = Field(max_length=2)
    note: str | None = Field(max_length=8)


class GetWeather(BaseModel):
    """Weather forecast for a city."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def oai(tiny_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", range(3))
def test_chat_parse_of_a_nested_model(oai, tiny_chat_server, seed):
    out = oai.chat.completions.parse(model=tiny_chat_server.model, messages=MESSAGES, response_format=Order,
                                     max_completion_tokens=200, temperature=1.0, seed=seed)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Order) and message.parsed == Order.model_validate_json(message.content)


def test_chat_stream_helper_parses_the_streamed_answer(oai, tiny_chat_server):
    kw = dict(model=tiny_chat_server.model, messages=MESSAGES, max_completion_tokens=200, temperature=1.0, seed=3)
    with oai.chat.completions.stream(**kw, response_format=Order) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e.delta for e in events if e.type == "content.delta"]
    done = [e for e in events if e.type == "content.done"]
    message = final.choices[0].message
    assert len(deltas) > 1 and "".join(deltas) == message.content
    assert len(done) == 1 and done[0].parsed == message.parsed and isinstance(message.parsed, Order)
    # The stream is the same answer as the whole one.
    assert oai.chat.completions.parse(**kw, response_format=Order).choices[0].message.parsed == message.parsed


def test_responses_parse_and_stream_helper_of_a_nested_model(oai, tiny_chat_server):
    kw = dict(model=tiny_chat_server.model, input=MESSAGES, max_output_tokens=200, temperature=1.0,
              extra_body={"seed": 2})
    whole = oai.responses.parse(**kw, text_format=Order)
    assert whole.status == "completed" and isinstance(whole.output_parsed, Order)
    with oai.responses.stream(**kw, text_format=Order) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.output_parsed == whole.output_parsed


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}])
def test_pydantic_function_tool_forced_by_tool_choice_parses(random_tool_chat_server, tool_choice):
    client = openai.OpenAI(base_url=f"{random_tool_chat_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    out = client.chat.completions.parse(model=random_tool_chat_server.model,
                                        messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice=tool_choice,
                                        parallel_tool_calls=False, max_completion_tokens=96, temperature=1.0, seed=1)
    assert out.choices[0].finish_reason == "tool_calls"
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
