"""Tool calling through the official SDKs against a real ``zllm serve``.

``tool_chat`` (tests/server/conftest.py) is a Qwen2 checkpoint written by transformers whose
weights make greedy decoding spell two Hermes tool calls (``get_weather`` with arguments,
``get_time`` with none) for any conversation, and transformers' ``generate`` is checked to
say the same. Its template is Qwen2.5's, which renders tools, assistant tool calls and tool
results, so these tests cover the whole path: a conversation with tool calls and results →
the template → the model → the Hermes parser → each protocol's tool-call shape, streamed
and not. Prompt token counts are compared with transformers' ``apply_chat_template(tools=)``.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import TIME_TOOL, TOOL_ANSWER_TEXT, WEATHER_TOOL

TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_ARGS = '{"city": "Paris", "days": 3}'
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# A finished tool round: the assistant's calls and their results.
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def oai(tool_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(tool_chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_chat_server.url, api_key="unused", max_retries=0, timeout=60)


def hf_prompt_tokens(tool_chat, messages, tools) -> int:
    from transformers import PreTrainedTokenizerFast

    # Not AutoTokenizer: for a qwen2 config transformers 5 builds Qwen2Tokenizer, which swaps in
    # Qwen's own pre-tokenizer regex instead of the one tokenizer.json holds (and zllm reads).
    tok = PreTrainedTokenizerFast.from_pretrained(tool_chat.path)
    hf_messages = []
    for m in messages:  # HF templates take arguments as a mapping
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        hf_messages.append(m)
    return len(tok.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])


def test_chat_answers_with_tool_calls(oai, tool_chat_server, tool_chat):
    out = oai.chat.completions.create(model=tool_chat_server.model, messages=HISTORY, tools=TOOLS, temperature=0,
                                      max_completion_tokens=16)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("function", "get_weather", WEATHER_ARGS), ("function", "get_time", "{}")]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert out.usage.prompt_tokens == hf_prompt_tokens(tool_chat, HISTORY, TOOLS)


def test_chat_streams_tool_calls_name_first_then_argument_fragments(oai, tool_chat_server):
    chunks = list(oai.chat.completions.create(model=tool_chat_server.model, messages=USER, tools=TOOLS,
                                              temperature=0, max_completion_tokens=16, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    firsts = {}
    args: dict[int, str] = {}
    for p in pieces:
        if p.index not in firsts:
            assert p.id and p.type == "function" and p.function.name
            firsts[p.index] = (p.id, p.function.name)
        else:
            assert p.id is None and p.function.name is None
        args[p.index] = args.get(p.index, "") + (p.function.arguments or "")
    assert [firsts[i][1] for i in sorted(firsts)] == ["get_weather", "get_time"]
    assert args == {0: WEATHER_ARGS, 1: "{}"}
    assert sum(1 for p in pieces if p.index == 0 and p.function.arguments) >= 2  # fragments, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_choice_none_leaves_the_call_text_as_content(oai, tool_chat_server):
    out = oai.chat.completions.create(model=tool_chat_server.model, messages=USER, tools=TOOLS, tool_choice="none",
                                      temperature=0, max_completion_tokens=16)
    assert out.choices[0].message.content == TOOL_ANSWER_TEXT and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_one_call(oai, tool_chat_server):
    out = oai.chat.completions.create(model=tool_chat_server.model, messages=USER, tools=TOOLS,
                                      parallel_tool_calls=False, temperature=0, max_completion_tokens=16)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
     ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]},
      "tools[0].function.parameters.type"),
     ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
     ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages[1].tool_call_id"),
     ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages[1].content"),
     ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
     ({"messages": [{"role": "user"}]}, "messages[0].content"),
     ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]},
      "messages[1].tool_calls[0].function.arguments")],
)
def test_bad_tool_input_is_400_naming_the_field_and_the_server_keeps_serving(oai, tool_chat_server, kw, param):
    args = {"model": tool_chat_server.model, "messages": USER, "max_completion_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**args)
    assert info.value.body["param"] == param and param.split("[")[0] in info.value.body["message"]
    assert tool_chat_server.healthy()


def test_a_template_that_cannot_render_tools_is_400_naming_tools(chat_server):
    client = openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=chat_server.model, messages=USER, tools=TOOLS, max_completion_tokens=4)
    assert info.value.body["param"] == "tools" and "does not render tools" in info.value.body["message"]


def test_responses_function_call_items(oai, tool_chat_server, tool_chat):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    out = oai.responses.create(model=tool_chat_server.model, input=[
        {"role": "user", "content": USER[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": WEATHER_ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}],
        tools=tools, temperature=0, max_output_tokens=16)
    calls = [item for item in out.output if item.type == "function_call"]
    assert [(c.name, c.arguments, c.status) for c in calls] == [
        ("get_weather", WEATHER_ARGS, "completed"), ("get_time", "{}", "completed")]
    assert out.status == "completed" and not out.output_text
    assert out.usage.input_tokens == hf_prompt_tokens(tool_chat, HISTORY, TOOLS)
    # The calls continue the stored conversation: answer them by previous_response_id.
    follow = oai.responses.create(model=tool_chat_server.model, previous_response_id=out.id, tools=tools,
                                  input=[{"type": "function_call_output", "call_id": c.call_id, "output": "ok"}
                                         for c in calls], temperature=0, max_output_tokens=16)
    assert [item.name for item in follow.output if item.type == "function_call"] == ["get_weather", "get_time"]


def test_responses_streams_function_call_events(oai, tool_chat_server):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    events = list(oai.responses.create(model=tool_chat_server.model, input=USER[0]["content"], tools=tools,
                                       temperature=0, max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added] == [("function_call", "get_weather"), ("function_call", "get_time")]
    deltas: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert done == {added[0].id: WEATHER_ARGS, added[1].id: "{}"} and deltas == done
    final = events[-1].response
    assert [(i.id, i.arguments) for i in final.output] == [(added[0].id, WEATHER_ARGS), (added[1].id, "{}")]


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ANTHROPIC_HISTORY = [
    {"role": "user", "content": USER[0]["content"]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris", "days": 3}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
]


def test_messages_tool_use_blocks(claude, tool_chat_server, tool_chat):
    msg = claude.messages.create(model=tool_chat_server.model, max_tokens=16, messages=ANTHROPIC_HISTORY,
                                 tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == [
        ("tool_use", "get_weather", {"city": "Paris", "days": 3}), ("tool_use", "get_time", {})]
    history = [*HISTORY[:1], {**HISTORY[1], "tool_calls": [
        {**HISTORY[1]["tool_calls"][0], "id": "toolu_1"}]}, {**HISTORY[2], "tool_call_id": "toolu_1"}]
    assert msg.usage.input_tokens == hf_prompt_tokens(tool_chat, history, TOOLS)


def test_messages_stream_input_json_deltas(claude, tool_chat_server):
    with claude.messages.stream(model=tool_chat_server.model, max_tokens=16, messages=ANTHROPIC_HISTORY[:1],
                                tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert "".join(partial) == WEATHER_ARGS + "{}" and len(partial) >= 3
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [("get_weather", {"city": "Paris", "days": 3}),
                                                           ("get_time", {})]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]}, "tools[0].name"),
     ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
     ({"tools": [{"name": "f", "input_schema": {"type": "strnig"}}]}, "tools[0].input_schema.type"),
     ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
     ({"messages": [*ANTHROPIC_HISTORY[:1], {"role": "assistant", "content": "ok"}, ANTHROPIC_HISTORY[2]]},
      "messages[2].content[0].tool_use_id"),
     ({"messages": [{"role": "user", "content": []}]}, "messages[0].content")],
)
def test_messages_bad_tool_input_is_400_in_anthropic_shape(tool_chat_server, kw, needle):
    body = {"model": tool_chat_server.model, "max_tokens": 4, "messages": ANTHROPIC_HISTORY[:1], **kw}
    r = httpx.post(f"{tool_chat_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert needle in r.json()["error"]["message"]
    assert tool_chat_server.healthy()


def test_engine_generate_returns_the_same_tool_calls(tool_chat):
    import zllm

    engine = zllm.Engine.from_config({"model": {"path": str(tool_chat.path)}, "backend": {"name": "cpu"}})
    out = engine.generate({"messages": USER, "tools": TOOLS, "max_tokens": 16, "temperature": 0})
    assert out["finish_reason"] == "tool_calls" and out["text"] == TOOL_ANSWER_TEXT and out["content"] == ""
    assert [(c["name"], c["arguments"]) for c in out["tool_calls"]] == [("get_weather", WEATHER_ARGS),
                                                                        ("get_time", "{}")]
