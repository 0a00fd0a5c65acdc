"""The OpenAI Agents SDK runs a whole tool loop against a real ``zllm serve``.

The agent (``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client on the local server)
sends the conversation and the tools, the model asks for tools, the SDK runs them, sends
their results back and the model answers; and an agent's ``output_type`` (a pydantic model)
comes back validated. Tracing is off (the SDK would report every run to
a remote service), and every test runs under a guard that refuses, and records, any
connection or name lookup outside the loopback interface.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from typing import Annotated, Literal

import openai
import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field

from tests.server.conftest import TOOL_ANSWER_TEXT

set_tracing_disabled(True)

USER = "What is the weather in Paris?"
WEATHER_REPORT = "sunny, 21 C"
NOW = "12:00"


def _loopback(host: object) -> bool:
    if host in ("localhost", None):
        return True
    try:
        return ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse connections and name lookups beyond loopback; fail the test if any was tried
    (a background thread's attempt would otherwise only be logged)."""
    refused: list[str] = []

    def guard(what: str, host: object) -> None:
        if not _loopback(host):
            refused.append(f"{what} {host!r}")
            raise ConnectionRefusedError(f"test guard: no network beyond loopback ({what} {host!r})")

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard("connect", address[0])
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard("connect", address[0])
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        guard("getaddrinfo", host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert refused == []


def _model(server) -> OpenAIChatCompletionsModel:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return OpenAIChatCompletionsModel(model=server.model, openai_client=client)


def _run(agent: Agent, text: str):
    return asyncio.run(Runner.run(agent, text, max_turns=4, run_config=RunConfig(tracing_disabled=True)))


def test_agent_runs_the_tools_the_model_asks_for_and_the_model_answers_their_results(tool_chat_server, tool_chat):
    ran: list[tuple[str, dict]] = []

    # The tools are offered until they have run: the model of ``tool_chat`` asks for them
    # whenever it is given tools, so its answer after the results is the turn without them.
    def offered(ctx, agent) -> bool:
        return not ran

    @function_tool(is_enabled=offered)
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        ran.append(("get_weather", {"city": city, "days": days}))
        return WEATHER_REPORT

    @function_tool(is_enabled=offered)
    def get_time() -> str:
        """The current time."""
        ran.append(("get_time", {}))
        return NOW

    agent = Agent(name="weather", instructions="You answer questions about the weather.",
                  tools=[get_weather, get_time], model=_model(tool_chat_server),
                  model_settings=ModelSettings(temperature=0, max_tokens=32))
    result = _run(agent, USER)

    assert ran == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallItem, ToolCallOutputItem, ToolCallOutputItem, MessageOutputItem]
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs == [WEATHER_REPORT, NOW]
    # The answer: without tools on offer the same tokens are text, not calls.
    assert result.final_output == TOOL_ANSWER_TEXT
    # The second request carried both results: its prompt is the template's rendering of the
    # conversation with the calls and their outputs.
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    history = [{"role": "system", "content": agent.instructions}, {"role": "user", "content": USER},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                   for c in calls]},
               *[{"role": "tool", "tool_call_id": c.call_id, "content": out} for c, out in zip(calls, outputs,
                                                                                             strict=True)]]
    asked, answered = result.raw_responses
    assert [c.name for c in asked.output] == ["get_weather", "get_time"]
    assert answered.usage.input_tokens == _hf_prompt_tokens(tool_chat, history)


def _hf_prompt_tokens(tool_chat, messages) -> int:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tool_chat.path)
    hf = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return len(tok.apply_chat_template(hf, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def test_a_random_weight_model_forced_by_tool_choice_required_makes_a_valid_call(random_tool_chat_server):
    ran: list[dict] = []

    # Bounds in the schema keep a random model's call short: the grammar enforces them.
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather forecast for a city."""
        ran.append({"city": city, "days": days})
        return WEATHER_REPORT

    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=_model(random_tool_chat_server),
                  model_settings=ModelSettings(temperature=0, max_tokens=96, tool_choice="required",
                                               parallel_tool_calls=False))
    result = _run(agent, USER)

    # The SDK validated the arguments against the tool's strict schema before running it.
    assert len(ran) == 1 and len(ran[0]["city"]) <= 12 and 1 <= ran[0]["days"] <= 7
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments) == ran[0]
    # After the call the SDK resets tool_choice to auto: the model answers in text, to a
    # prompt that now holds the call and its result.
    asked, answered = result.raw_responses
    assert [type(item).__name__ for item in answered.output] == ["ResponseOutputMessage"]
    assert result.final_output == answered.output[0].content[0].text
    assert answered.usage.input_tokens > asked.usage.input_tokens


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)
    conditions: list[Literal["sun", "rain", "wind"]] = Field(max_length=3)


def test_agent_output_type_is_a_model_the_sdk_validated(tiny_chat_server):
    # The SDK asks for its output type's strict JSON schema (response_format) and validates
    # the answer into the model; a random-weight model gets there only by the grammar.
    agent = Agent(name="forecaster", instructions="You write forecasts.", output_type=Forecast,
                  model=_model(tiny_chat_server),
                  model_settings=ModelSettings(temperature=1.0, max_tokens=200, extra_body={"seed": 4}))
    result = _run(agent, USER)
    assert isinstance(result.final_output, Forecast)
    [response] = result.raw_responses
    assert Forecast.model_validate_json(response.output[0].content[0].text) == result.final_output
