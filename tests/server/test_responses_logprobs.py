"""Responses logprobs (``include: ["message.output_text.logprobs"]``, ``top_logprobs``) through
the openai SDK: the ``output_text`` part's and the streamed ``response.output_text.delta``
events' ``logprobs``, checked against Chat's logprobs of the same seeded request (both are
the engine's, computed by the runtime sampler) and against an in-process Engine."""

from __future__ import annotations

import httpx
import openai
import pytest

import zllm
from tests.server.test_openai_chat import MESSAGES

INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _kw(chat_server, **extra):
    return dict(model=chat_server.model, input=MESSAGES, max_output_tokens=10, temperature=0.8,
                extra_body={"seed": 4}, **extra)  # seed: a zllm extension on Responses


def test_output_text_logprobs_are_the_engines(client, chat_server):
    out = client.responses.create(**_kw(chat_server), include=INCLUDE, top_logprobs=3)
    part = out.output[0].content[0]
    assert part.type == "output_text" and out.top_logprobs == 3
    local = zllm.Engine.from_config(chat_server.config)
    mine = local.generate({"messages": MESSAGES, "max_tokens": 10, "temperature": 0.8, "seed": 4, "logprobs": 3})
    assert part.text == mine["content"]
    assert len(part.logprobs) == out.usage.output_tokens == len(mine["logprobs"])
    assert [e.token for e in part.logprobs] == [e["token"] for e in mine["logprobs"]]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e["logprob"] for e in mine["logprobs"]], abs=1e-4)
    for e, m in zip(part.logprobs, mine["logprobs"], strict=True):
        assert e.bytes == list(e.token.encode("utf-8"))
        assert [t.token for t in e.top_logprobs] == [t["token"] for t in m["top_logprobs"]]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([t["logprob"] for t in m["top_logprobs"]],
                                                                    abs=1e-4)
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in e.top_logprobs)


def test_output_text_logprobs_equal_chats_for_the_same_request(client, chat_server):
    responses = client.responses.create(**_kw(chat_server), include=INCLUDE, top_logprobs=2)
    chat = client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=10,
                                          temperature=0.8, seed=4, logprobs=True, top_logprobs=2)
    ours = responses.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in ours] == [(e.token, e.logprob, e.bytes) for e in theirs]


def test_streamed_deltas_carry_their_tokens_logprobs(client, chat_server):
    whole = client.responses.create(**_kw(chat_server), include=INCLUDE, top_logprobs=1)
    events = list(client.responses.create(**_kw(chat_server), include=INCLUDE, top_logprobs=1, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for d in deltas for lp in d.logprobs]
    expected = whole.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in streamed] == [(e.token, e.logprob) for e in expected]
    assert all(len(lp.top_logprobs) == 1 for lp in streamed)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [(e.token, e.logprob) for e in expected]
    completed = events[-1].response.output[0].content[0]
    assert [(e.token, e.logprob) for e in completed.logprobs] == [(e.token, e.logprob) for e in expected]


def test_without_the_include_no_logprobs_are_reported(client, chat_server):
    out = client.responses.create(**_kw(chat_server))
    assert out.output[0].content[0].logprobs == []


@pytest.mark.parametrize(("extra", "param"), [
    ({"include": INCLUDE, "top_logprobs": 21}, "top_logprobs"),
    ({"include": INCLUDE, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without the include
    ({"include": ["message.output_text.logprob"]}, "include[0]"),
    ({"include": "message.output_text.logprobs"}, "include"),
])
def test_bad_logprobs_fields_are_400_naming_the_field(chat_server, extra, param):
    body = {"model": chat_server.model, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(chat_server.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert chat_server.healthy()
