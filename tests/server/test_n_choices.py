"""``n`` > 1 on Completions and Chat: n independent samples, each its own engine request.

The servers run in batch-invariant mode (tests/server/conftest.py), so a choice sampled next
to its siblings must equal the same request sent alone with the seed it was given
(``seed + index``): that pins both the seeding rule and that the choices do not mix.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.test_concurrency import wait_until

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_choices_are_the_requests_seeded_seed_plus_index(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                       seed=7 + i) for i in range(3)]
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in out.choices}) > 1  # different seeds, different samples
    assert out.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_choices_each_have_their_message_and_finish_reason(chat_client, chat_server):
    out = chat_client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=10,
                                              temperature=1.0, seed=3, n=4, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, choice in enumerate(out.choices):
        alone = chat_client.chat.completions.create(model=chat_server.model, messages=MESSAGES,
                                                    max_completion_tokens=10, temperature=1.0, seed=3 + i)
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
        assert len(choice.logprobs.content) == alone.usage.completion_tokens
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_streamed_completion_choices_interleave_by_index_each_with_its_finish(client, server):
    body = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11, n=3)
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        choice = c.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.text for c in whole.choices]
    assert finishes == {i: [whole.choices[i].finish_reason] for i in range(3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_chat_choices_open_with_a_role_per_index(chat_client, chat_server):
    body = dict(model=chat_server.model, messages=MESSAGES, max_completion_tokens=8, temperature=1.0, seed=5, n=2)
    whole = chat_client.chat.completions.create(**body)
    chunks = list(chat_client.chat.completions.create(**body, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_unseeded_choices_are_independent_samples(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=1.0, n=4)
    assert len({c.text for c in out.choices}) > 1


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_outside_1_to_16_is_a_400_naming_n(server, n):
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "n": n}, timeout=10)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "n" and "1 to 16" in err["message"]
    assert server.healthy()


def test_a_bad_request_with_n_opens_no_sequence(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 3, "top_p": 0},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert wait_until(lambda: server.metrics()["zllm_num_requests_running"] == 0)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_choice(server, stream):
    idle = server.metrics()
    assert idle["zllm_num_requests_running"] == 0
    body = {"model": server.model, "prompt": [311 + stream, 42, 43], "max_tokens": 480, "ignore_eos": True,
            "temperature": 1.0, "n": 3, "stream": stream}
    seen: set[int] = set()
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # kept: a dropped iterator closes the connection early
                while len(seen) < 3:
                    line = next(lines)
                    if line.startswith("data: {"):
                        seen.add(json.loads(line[6:])["choices"][0]["index"])
                assert server.metrics()["zllm_num_requests_running"] == 3
        else:
            # A non-streamed request abandoned by its client (read timeout) is aborted too.
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    assert wait_until(lambda: server.metrics()["zllm_num_requests_running"] == 0)
    after = server.metrics()
    assert after["zllm_kv_blocks_running"] == 0
    # Every token but each stream's first adds an inter-token latency sample.
    generated = after["zllm_inter_token_latency_seconds_count"] - idle["zllm_inter_token_latency_seconds_count"] + 3
    assert 3 <= generated < 3 * 400  # aborted well before their 480 tokens each
    assert server.healthy()


def test_echo_with_n_echoes_the_prompt_in_every_choice(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=9, n=2,
                                    echo=True, logprobs=1)
    alone = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    prompt_tokens = alone.choices[0].logprobs.tokens[: alone.usage.prompt_tokens]
    for choice in out.choices:
        assert choice.text.startswith(PROMPT)
        assert choice.logprobs.tokens[: len(prompt_tokens)] == prompt_tokens
        assert len(choice.logprobs.tokens) == len(prompt_tokens) + 4
