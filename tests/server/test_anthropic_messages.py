"""/v1/messages through the official anthropic SDK, on stories260K with a chat template."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.conftest import needs_messages

pytestmark = needs_messages

USER = [{"role": "user", "content": "Once upon a time"}]
SYSTEM = "You tell stories."


@pytest.fixture(scope="module")
def client(chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=chat_server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(chat_server):
    """The same conversation through Chat Completions (the same engine request)."""
    body = {"model": chat_server.model, "messages": [{"role": "system", "content": SYSTEM}, *USER],
            "max_completion_tokens": 24, "temperature": 0}
    return httpx.post(f"{chat_server.url}/v1/chat/completions", json=body, timeout=60).json()


def test_message_with_system_matches_chat_completions(client, chat_server, reference):
    msg = client.messages.create(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == chat_server.model
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == reference["choices"][0]["message"]["content"]
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.input_tokens == reference["usage"]["prompt_tokens"] and msg.usage.output_tokens == 24


def test_system_as_text_blocks(client, chat_server, reference):
    msg = client.messages.create(model=chat_server.model, max_tokens=24, messages=USER,
                                 system=[{"type": "text", "text": SYSTEM}])
    assert msg.content[0].text == reference["choices"][0]["message"]["content"]


def test_stop_sequences_report_which_one_matched(client, chat_server, reference):
    text = reference["choices"][0]["message"]["content"]
    stop = text.split()[2]
    msg = client.messages.create(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER,
                                 stop_sequences=["never-generated-zzz", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


def test_end_turn_when_the_model_stops_by_itself(client, chat_server):
    # Greedy, this conversation ends on the model's own end-of-story token after 322 tokens.
    msg = client.messages.create(model=chat_server.model, max_tokens=400,
                                 messages=[{"role": "user", "content": "The end."}])
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 322


def test_stream_event_sequence(client, chat_server, reference):
    with client.messages.stream(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[1] == "content_block_start"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta", "text"}
    assert events[0].message.usage.input_tokens == reference["usage"]["prompt_tokens"]
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 24
    # The SDK's stream helper accumulates the text deltas into the final message.
    assert final.content[0].text == reference["choices"][0]["message"]["content"]
    assert final.stop_reason == "max_tokens"


def test_text_stream_helper(client, chat_server, reference):
    with client.messages.stream(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER) as stream:
        assert "".join(stream.text_stream) == reference["choices"][0]["message"]["content"]


def test_stream_stop_sequence_in_message_delta(client, chat_server, reference):
    stop = reference["choices"][0]["message"]["content"].split()[2]
    with client.messages.stream(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_sdk_raises_typed_errors(client, chat_server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=chat_server.model, max_tokens=0, messages=USER)
    assert info.value.body["type"] == "error" and "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-unknown", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=chat_server.model, max_tokens=5, messages=USER,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])


def test_metadata_is_accepted_and_ignored(client, chat_server, reference):
    msg = client.messages.create(model=chat_server.model, max_tokens=24, system=SYSTEM, messages=USER,
                                 metadata={"user_id": "u-1"})
    assert msg.content[0].text == reference["choices"][0]["message"]["content"]


def test_sampling_fields_via_extra_body(client, chat_server):
    # The current SDK no longer has temperature/top_p/top_k arguments; older clients send them.
    kw = dict(model=chat_server.model, max_tokens=16, messages=USER,
              extra_body={"temperature": 1.0, "top_k": 20})
    a, b = client.messages.create(**kw), client.messages.create(**kw)
    assert a.usage.output_tokens >= 1 and b.usage.output_tokens >= 1
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=chat_server.model, max_tokens=16, messages=USER, extra_body={"top_p": 0})
    assert "top_p" in info.value.body["error"]["message"]


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "user", "content": []}])
def test_missing_null_or_empty_content_is_400_naming_it(chat_server, message):
    r = httpx.post(f"{chat_server.url}/v1/messages", timeout=60,
                   json={"model": chat_server.model, "max_tokens": 4, "messages": [message]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["message"].startswith("messages[0].content:")
    assert chat_server.healthy()
