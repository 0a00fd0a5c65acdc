"""/v1/responses through the official openai SDK, on stories260K with a chat template."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import needs_messages

pytestmark = needs_messages

INSTRUCTIONS = "You tell stories."


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(client, chat_server):
    """The same conversation through Chat Completions."""
    return client.chat.completions.create(
        model=chat_server.model, max_completion_tokens=24, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Once upon a time"}])


def test_string_input_with_instructions_matches_chat(client, chat_server, reference):
    r = client.responses.create(model=chat_server.model, input="Once upon a time", instructions=INSTRUCTIONS,
                                max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.model == chat_server.model
    assert r.output_text == reference.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == reference.usage.prompt_tokens and r.usage.output_tokens == 24


def test_message_items_input(client, chat_server, reference):
    r = client.responses.create(
        model=chat_server.model, max_output_tokens=24, temperature=0,
        input=[{"role": "developer", "content": INSTRUCTIONS},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}])
    assert r.output_text == reference.choices[0].message.content


def test_completed_when_the_model_stops(client, chat_server, reference):
    stop = reference.choices[0].message.content.split()[2]
    r = client.responses.create(model=chat_server.model, input="Once upon a time", instructions=INSTRUCTIONS,
                                max_output_tokens=24, temperature=0, extra_body={"stop": [stop]})
    assert r.status == "completed" and r.incomplete_details is None


def test_stream_event_sequence_and_accumulator(client, chat_server, reference):
    kw = dict(model=chat_server.model, input="Once upon a time", instructions=INSTRUCTIONS, max_output_tokens=24,
              temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = reference.choices[0].message.content
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    # The SDK's stream helper accumulates the events into the final response (it returns
    # one only after response.completed, so end this one with a stop string).
    stop = text.split()[2]
    with client.responses.stream(**kw, extra_body={"stop": [stop]}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas == text[: text.index(stop)]


def test_previous_response_id_continues_the_conversation(client, chat_server):
    first = client.responses.create(model=chat_server.model, input="Once upon a time", max_output_tokens=8,
                                    temperature=0)
    follow = client.responses.create(model=chat_server.model, input="And then?", max_output_tokens=8,
                                     temperature=0, previous_response_id=first.id)
    by_hand = client.responses.create(
        model=chat_server.model, max_output_tokens=8, temperature=0, store=False,
        input=[{"role": "user", "content": "Once upon a time"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}])
    assert follow.output_text == by_hand.output_text
    assert follow.usage.input_tokens == by_hand.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(by_hand.id)  # store=False keeps nothing
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=chat_server.model, input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"input": []}, "input"), ({"max_output_tokens": 0}, "max_output_tokens"),
     ({"temperature": -1}, "temperature"), ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
     ({"reasoning": {"effort": "high"}}, "reasoning"),
     ({"text": {"format": {"type": "yaml"}}}, "text.format.type")],
)
def test_bad_fields_are_400_naming_the_field(client, chat_server, kw, param):
    args = {"model": chat_server.model, "input": "Hi", **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    assert info.value.body["param"] == param
    assert param.split(".")[0] in info.value.body["message"]


@pytest.mark.parametrize(
    ("input_", "param"),
    [("", "input"), ([{"role": "user", "content": []}], "input[0].content"),
     ([{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant", "content": []}],
      "input[1].content")],
)
def test_empty_input_or_message_content_is_400_naming_it(client, chat_server, input_, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=chat_server.model, input=input_, max_output_tokens=4)
    assert info.value.body["param"] == param and info.value.body["message"].startswith(param + ":")
    assert chat_server.healthy()
