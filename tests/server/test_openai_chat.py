"""/v1/chat/completions through the official openai SDK, on stories260K with a chat template."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import needs_messages

pytestmark = needs_messages

MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def completion_of_rendered_prompt(chat_server, client):
    """The same conversation rendered by hand with the test template, sent as a completion."""
    prompt = "<|system|>\nYou tell stories.\n<|user|>\nOnce upon a time\n<|assistant|>\n"
    return client.completions.create(model=chat_server.model, prompt=prompt, max_tokens=20, temperature=0)


def test_chat_equals_the_completion_of_the_rendered_template(client, chat_server, completion_of_rendered_prompt):
    out = client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=20,
                                         temperature=0)
    assert out.object == "chat.completion" and out.model == chat_server.model
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == completion_of_rendered_prompt.choices[0].text
    assert out.usage.prompt_tokens == completion_of_rendered_prompt.usage.prompt_tokens
    assert out.usage.completion_tokens == 20


def test_deprecated_max_tokens_and_developer_role(client, chat_server, completion_of_rendered_prompt):
    messages = [{"role": "developer", "content": "You tell stories."}, MESSAGES[1]]
    out = client.chat.completions.create(model=chat_server.model, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == completion_of_rendered_prompt.choices[0].text


def test_content_parts_are_joined(client, chat_server, completion_of_rendered_prompt):
    messages = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Once upon "},
                                                          {"type": "text", "text": "a time"}]}]
    out = client.chat.completions.create(model=chat_server.model, messages=messages, max_completion_tokens=20,
                                         temperature=0)
    assert out.choices[0].message.content == completion_of_rendered_prompt.choices[0].text


def test_stream_with_usage(client, chat_server, completion_of_rendered_prompt):
    chunks = list(client.chat.completions.create(
        model=chat_server.model, messages=MESSAGES, max_completion_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage = chunks[:-1], chunks[-1]
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == completion_of_rendered_prompt.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_stop_sequence_gives_finish_reason_stop(client, chat_server, completion_of_rendered_prompt):
    text = completion_of_rendered_prompt.choices[0].text
    stop = text.split()[2]
    out = client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=20,
                                         temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]


def test_sdk_parse_of_bad_request_raises_bad_request_error(client, chat_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=chat_server.model, messages=MESSAGES, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-unknown", messages=MESSAGES)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_options_without_stream_is_a_400_naming_it(client, chat_server, route):
    # OpenAI and vLLM refuse it; zllm accepted it and answered without usage chunks.
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_tokens=2,
                                           stream_options={"include_usage": True})
        else:
            client.completions.create(model=chat_server.model, prompt="Once", max_tokens=2,
                                      stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"
    assert client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_tokens=2).choices
