"""Every chat format's parser on golden strings, whole and in any chunking.

The golden strings are the formats as their models emit them (the chat templates' own
instructions, the vendors' format guides); each test states the content, reasoning and
tool calls the text means. The hypothesis tests cut the same texts at random places and
demand exactly the whole-text result, so streaming can never disagree with a non-streamed
answer, and the argument fragments of every call concatenate to its final JSON string.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.engine.tool_parsers import FORMATS, ParsedOutput, ToolCall, make_output_parser, parse_output, resolve_format
from zllm.engine.tool_parsers.base import merge
from zllm.engine.tool_parsers.mistral import mistral_call_id

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                     "ratio": {"type": "number"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def counter_ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def parser(fmt: str, *, template: str = "", prompt_text: str = "", parallel: bool = True, tools=TOOLS):
    return make_output_parser(resolve_format(fmt, None), tools=tools, template=template, prompt_text=prompt_text,
                              parallel_tool_calls=parallel, new_id=counter_ids())


def calls(*pairs: tuple[str, str]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(f"id{i}", name, args) for i, (name, args) in enumerate(pairs))


THINK_TEMPLATE = "{{ '<think>' }}{{ '</think>' }}"

# (format, template, text, expected) — the golden strings.
GOLDEN = [
    pytest.param("hermes", "", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                 ParsedOutput("Let me check.", "", calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
                 id="hermes-two-calls"),
    pytest.param("hermes", "", "Just text, with a < and a <tool but no call.",
                 ParsedOutput("Just text, with a < and a <tool but no call.", "", ()), id="hermes-text"),
    pytest.param("hermes", "", '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Rome"}'))), id="hermes-arguments-first"),
    pytest.param("hermes", "", "<tool_call>not json</tool_call> after",
                 ParsedOutput("<tool_call>not json</tool_call> after", "", ()), id="hermes-not-a-call"),
    pytest.param("hermes", "", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Pa'))), id="hermes-cut-by-max-tokens"),
    pytest.param("hermes", THINK_TEMPLATE, '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a \\"quoted\\" } brace"}}'
                 '\n</tool_call>',
                 ParsedOutput("", "\nThe user wants weather.\n",
                              calls(("get_weather", '{"city": "Oslo", "note": "a \\"quoted\\" } brace"}'))),
                 id="qwen3-think-then-call"),
    pytest.param("none", THINK_TEMPLATE, "<think>hmm</think>\n\nThe answer is 4.",
                 ParsedOutput("The answer is 4.", "hmm", ()), id="think-only"),
    pytest.param("qwen3_coder", "", "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
                 "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
                 "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
                 "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
                 ParsedOutput("I will look.", "", calls(("get_weather", json.dumps(
                     {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": 0.5, "extra": "42"})))),
                 id="qwen3-coder-cast-by-schema"),
    pytest.param("qwen3_coder", "", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n"
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</function>\n</tool_call>",
                 ParsedOutput("", "", calls(("get_time", "{}"), ("get_weather", '{"city": "Lima"}'))),
                 id="qwen3-coder-no-params-and-missing-end-tag"),
    pytest.param("llama3_json", "", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Paris"}'))), id="llama3-json"),
    pytest.param("llama3_json", "", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_time", "parameters": {}}',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
                 id="llama3-python-tag-two-calls"),
    pytest.param("llama3_json", "", "The weather is {unknown} today.",
                 ParsedOutput("The weather is {unknown} today.", "", ()), id="llama3-text"),
    pytest.param("llama3_json", "", '{"answer": 42}', ParsedOutput('{"answer": 42}', "", ()), id="llama3-plain-json"),
    pytest.param("mistral", "", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {}}]',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
                 id="mistral-v3"),
    pytest.param("mistral", "", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, {"a": "}"}]}'
                 '[TOOL_CALLS]get_time[ARGS]{}',
                 ParsedOutput("Sure.", "", calls(("get_weather", '{"city": "Paris", "days": [1, {"a": "}"}]}'),
                                                 ("get_time", "{}"))), id="mistral-v11"),
    pytest.param("deepseek_v3", "", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                 'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
                 "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                 "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                 ParsedOutput("Checking.", "", calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))),
                 id="deepseek-v3"),
    pytest.param("deepseek_v3", "", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                 '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                 ParsedOutput("", "", calls(("get_weather", '{"city": "Paris"}'))), id="deepseek-v3.1"),
    pytest.param("harmony", "", "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                 "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city":"Tokyo"}<|call|>',
                 ParsedOutput("", "Need the weather tool.", calls(("get_weather", '{"city":"Tokyo"}'))),
                 id="harmony-call"),
    pytest.param("harmony", "", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is 4.<|return|>", ParsedOutput("It is 4.", "Easy.", ()), id="harmony-final"),
    pytest.param("harmony", "", "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
                 ParsedOutput("", "", calls(("get_time", "{}"))), id="harmony-recipient-in-role"),
]


@pytest.mark.parametrize(("fmt", "template", "text", "expected"), GOLDEN)
def test_golden_string_parses_to_its_content_reasoning_and_calls(fmt, template, text, expected):
    assert parse_output(parser(fmt, template=template), text) == expected


@pytest.mark.parametrize(("fmt", "template", "text", "expected"), GOLDEN)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_whole_text_result(fmt, template, text, expected, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    p = parser(fmt, template=template)
    deltas = [p.feed(piece) for piece in pieces] + [p.finish()]
    assert merge(deltas) == expected


@pytest.mark.parametrize(("fmt", "template", "text", "expected"), GOLDEN)
def test_one_character_at_a_time_sends_the_name_before_any_argument(fmt, template, text, expected):
    p = parser(fmt, template=template)
    seen: dict[int, str] = {}
    for ch in text + "\0":
        delta = p.finish() if ch == "\0" else p.feed(ch)
        for c in delta.tool_calls:
            if c.index not in seen:
                assert c.name is not None and c.id is not None
                seen[c.index] = c.name
            else:
                assert c.name is None and c.id is None
    assert [seen[i] for i in sorted(seen)] == [c.name for c in expected.tool_calls]


def test_hermes_arguments_stream_in_several_fragments():
    p = parser("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    fragments = [c.arguments for ch in text for c in p.feed(ch).tool_calls]
    assert "".join(fragments) == '{"city": "Paris", "days": 3}'
    assert sum(1 for f in fragments if f) > 5


def test_without_tools_tool_call_text_stays_the_answer():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert parse_output(parser("hermes", tools=[]), text) == ParsedOutput(text, "", ())


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_time", ' \
           '"arguments": {}}</tool_call>'
    assert parse_output(parser("hermes", parallel=False), text).tool_calls == calls(("get_weather", "{}"))


def test_a_prompt_that_opens_think_starts_the_answer_in_reasoning():
    p = parser("none", template=THINK_TEMPLATE, prompt_text="<|im_start|>assistant\n<think>\n")
    assert parse_output(p, "weighing it</think>\nDone.") == ParsedOutput("Done.", "weighing it", ())


def test_mistral_call_ids_are_nine_alphanumerics():
    ids = {mistral_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_format_is_detected_from_its_template_markers(fmt):
    from zllm.engine.tool_parsers import detect_format

    assert detect_format("{{ x }} " + " ".join(fmt.template_markers)) == fmt


def test_plain_chatml_template_has_no_tool_format():
    from zllm.engine.tool_parsers import detect_format

    assert detect_format("{{ '<|im_start|>' + message['role'] }}") is None
