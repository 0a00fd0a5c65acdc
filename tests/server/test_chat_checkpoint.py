"""The chat routes against transformers on a real chat checkpoint, through the official SDKs.

``tiny_chat`` (tests/server/conftest.py) is a random-weight ``LlamaForCausalLM`` and a
byte-level BPE tokenizer with ChatML special tokens and chat template, all written by
transformers' ``save_pretrained``; transformers' own ``apply_chat_template`` +
``generate(do_sample=False)`` gives the reference. Every route — Chat Completions, Responses,
Messages; streamed and not — must return exactly that text for the same conversation, with
the prompt and completion token counts of transformers' ids (so the template rendering, the
special-token handling and every generated id agree, not just the visible text).
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import TINY_CHAT_MAX_TOKENS as N
from tests.server.conftest import needs_messages

pytestmark = needs_messages


@pytest.fixture(scope="module")
def oai(tiny_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(tiny_chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_chat_server.url, api_key="unused", max_retries=0, timeout=60)


def chat_messages(tiny_chat) -> list[dict[str, str]]:
    return [{"role": "system", "content": tiny_chat.system}, {"role": "user", "content": tiny_chat.user}]


def test_the_reference_is_a_real_chatml_generation(tiny_chat):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat.path)
    rendered = tok.decode(tiny_chat.prompt_ids)
    assert rendered == (f"<|im_start|>system\n{tiny_chat.system}<|im_end|>\n<|im_start|>user\n{tiny_chat.user}"
                        "<|im_end|>\n<|im_start|>assistant\n")
    assert len(tiny_chat.output_ids) == N and tiny_chat.text


def test_completion_of_the_template_ids_matches(oai, tiny_chat_server, tiny_chat):
    out = oai.completions.create(model=tiny_chat_server.model, prompt=tiny_chat.prompt_ids, max_tokens=N,
                                 temperature=0)
    assert out.choices[0].text == tiny_chat.text
    assert out.usage.prompt_tokens == len(tiny_chat.prompt_ids) and out.usage.completion_tokens == N


def test_chat_completions(oai, tiny_chat_server, tiny_chat):
    out = oai.chat.completions.create(model=tiny_chat_server.model, messages=chat_messages(tiny_chat),
                                      max_completion_tokens=N, temperature=0)
    assert out.choices[0].message.content == tiny_chat.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tiny_chat.prompt_ids) and out.usage.completion_tokens == N


def test_chat_completions_stream(oai, tiny_chat_server, tiny_chat):
    chunks = list(oai.chat.completions.create(
        model=tiny_chat_server.model, messages=chat_messages(tiny_chat), max_completion_tokens=N, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tiny_chat.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(tiny_chat.prompt_ids) and chunks[-1].usage.completion_tokens == N


def test_responses(oai, tiny_chat_server, tiny_chat):
    out = oai.responses.create(model=tiny_chat_server.model, instructions=tiny_chat.system, input=tiny_chat.user,
                               max_output_tokens=N, temperature=0)
    assert out.output_text == tiny_chat.text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == len(tiny_chat.prompt_ids) and out.usage.output_tokens == N


def test_responses_stream(oai, tiny_chat_server, tiny_chat):
    stream = oai.responses.create(model=tiny_chat_server.model, instructions=tiny_chat.system, input=tiny_chat.user,
                                  max_output_tokens=N, temperature=0, stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == tiny_chat.text
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == tiny_chat.text
    assert last.response.usage.input_tokens == len(tiny_chat.prompt_ids) and last.response.usage.output_tokens == N


def test_responses_stream_accumulator(oai, tiny_chat_server, tiny_chat):
    # The SDK's helper returns a final response only after response.completed, so a stop
    # string (zllm's extension on Responses) ends this one before the token limit.
    stop = tiny_chat.text[-3:]
    expected = tiny_chat.text[: tiny_chat.text.index(stop)]
    with oai.responses.stream(model=tiny_chat_server.model, instructions=tiny_chat.system,
                              input=[{"role": "user", "content": tiny_chat.user}], max_output_tokens=N,
                              temperature=0, extra_body={"stop": [stop]}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) == expected


def test_messages(claude, tiny_chat_server, tiny_chat):
    msg = claude.messages.create(model=tiny_chat_server.model, max_tokens=N, system=tiny_chat.system,
                                 messages=[{"role": "user", "content": tiny_chat.user}],
                                 extra_body={"temperature": 0.0})
    assert msg.content[0].text == tiny_chat.text and msg.stop_reason == "max_tokens"
    assert msg.usage.input_tokens == len(tiny_chat.prompt_ids) and msg.usage.output_tokens == N


def test_messages_stream(claude, tiny_chat_server, tiny_chat):
    with claude.messages.stream(model=tiny_chat_server.model, max_tokens=N, system=tiny_chat.system,
                                messages=[{"role": "user", "content": tiny_chat.user}],
                                extra_body={"temperature": 0.0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == tiny_chat.text and final.content[0].text == tiny_chat.text
    assert final.usage.input_tokens == len(tiny_chat.prompt_ids) and final.usage.output_tokens == N
