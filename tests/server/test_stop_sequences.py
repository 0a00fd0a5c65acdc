"""Stop sequences over HTTP when the answer's first token carries a SentencePiece leading space.

stories260K with a template that runs the messages' text together (a base model's prompt):
greedy, "Lily went to" goes on with " the park with her mom."; its first token is "▁the".
Decoding the answer's tokens alone drops that space, so a stop sequence that begins with it
is only found in the text the engine generated — the engine reports the one it cut at.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import chat_model_dir, needs_messages, start_server

pytestmark = needs_messages

RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
PROMPT = "Lily went to"
ANSWER = " the park with"  # the greedy answer starts so (checked by the fixture)
MESSAGES = [{"role": "user", "content": PROMPT}]
STOPS = [" the", " the park", " park with"]


@pytest.fixture(scope="module")
def raw_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-raw")
    srv = start_server(tmp, chat_model_dir(tmp / "stories-raw", RAW_TEMPLATE),
                       server={"served_model_name": "stories-raw"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(raw_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{raw_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(raw_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=raw_server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def answer(oai, raw_server) -> str:
    text = oai.chat.completions.create(model=raw_server.model, messages=MESSAGES, max_completion_tokens=8,
                                       temperature=0).choices[0].message.content
    assert text.startswith(ANSWER)
    return text


@pytest.mark.parametrize("stop", STOPS)
def test_messages_report_the_stop_sequence_that_matched(claude, raw_server, answer, stop):
    msg = claude.messages.create(model=raw_server.model, max_tokens=8, messages=MESSAGES,
                                 stop_sequences=["never-generated-zzz", stop], extra_body={"temperature": 0})
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == answer[: answer.index(stop)]


@pytest.mark.parametrize("stop", STOPS)
def test_streamed_messages_report_the_stop_sequence_that_matched(claude, raw_server, answer, stop):
    with claude.messages.stream(model=raw_server.model, max_tokens=8, messages=MESSAGES, stop_sequences=[stop],
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", stop)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == answer[: answer.index(stop)]


def test_messages_without_a_matching_stop_sequence_report_none(claude, raw_server):
    msg = claude.messages.create(model=raw_server.model, max_tokens=8, messages=MESSAGES,
                                 stop_sequences=["never-generated-zzz"], extra_body={"temperature": 0})
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)


@pytest.mark.parametrize("stop", STOPS)
def test_chat_completions_cut_at_the_stop_sequence(oai, raw_server, answer, stop):
    out = oai.chat.completions.create(model=raw_server.model, messages=MESSAGES, max_completion_tokens=8,
                                      temperature=0, stop=["never-generated-zzz", stop])
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (answer[: answer.index(stop)], "stop")
    chunks = list(oai.chat.completions.create(model=raw_server.model, messages=MESSAGES, max_completion_tokens=8,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer[: answer.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stop", STOPS)
def test_completions_cut_at_the_stop_sequence(oai, raw_server, answer, stop):
    out = oai.completions.create(model=raw_server.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (answer[: answer.index(stop)], "stop")
    chunks = list(oai.completions.create(model=raw_server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == answer[: answer.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
