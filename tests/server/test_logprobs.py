"""logprobs through the official openai SDK against a real ``zllm serve``: completions
(``logprobs: n``, ``echo``) and chat (``logprobs: true, top_logprobs: n``), whole and
streamed, checked against a direct log-softmax of the same model's logits computed by an
in-process Engine of the same config (``Engine.prompt_logits``)."""

from __future__ import annotations

import openai
import pytest
import torch

import zllm
from tests.server.conftest import needs_messages
from tests.server.test_openai_chat import MESSAGES

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(server) -> zllm.Engine:
    return zllm.Engine.from_config(server.config)


def raw_logprobs(engine: zllm.Engine, ids: list[int]) -> torch.Tensor:
    """f64 log-softmax of the logits at every position of ``ids``: ``[len(ids), V]``."""
    return torch.log_softmax(engine.prompt_logits(ids).double(), dim=-1)


def test_completion_logprobs_are_the_log_softmax_of_the_models_logits(client, server, local):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    prompt_ids = local.tokenizer.encode(PROMPT)
    ids = local.generate({"prompt": PROMPT, "max_tokens": 10, "temperature": 0})["token_ids"]
    expected = raw_logprobs(local, prompt_ids + ids[:-1])[len(prompt_ids) - 1:]  # [N, V]
    lp = out.choices[0].logprobs
    assert lp.tokens == [local.token_text(t) for t in ids]
    assert lp.token_logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = expected[i].topk(3)
        assert top == pytest.approx({local.token_text(t): float(v) for t, v in zip(best.indices.tolist(),
                                                                                    best.values, strict=True)},
                                    abs=1e-4)
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy took the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_completion_logprobs_add_up_to_the_whole_ones(client, server):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=3, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.logprobs.token_logprobs
    assert [o for p in parts for o in p.text_offset] == whole.logprobs.text_offset
    assert "".join(c.text for c in chunks) == whole.text


def test_echo_returns_the_prompt_and_its_logprobs_first(client, server, local):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                    logprobs=1)
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    prompt_ids = local.tokenizer.encode(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 5 and lp.tokens[:len(prompt_ids)] == [
        local.token_text(t) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = raw_logprobs(local, prompt_ids)
    assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(
        [float(expected[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))], abs=1e-4)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[len(prompt_ids)] == sum(len(t) for t in lp.tokens[:len(prompt_ids)])
    echoed_only = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                            echo=True)
    assert echoed_only.choices[0].text == choice.text and echoed_only.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_first(client, server):
    chunks = [c.choices[0] for c in client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                                              temperature=0, echo=True, logprobs=0, stream=True)
              if c.choices]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[0] is None
    assert all(top == {} for top in chunks[1].logprobs.top_logprobs)  # logprobs 0: the chosen token only


@pytest.fixture(scope="module")
def chat_client(chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@needs_messages
def test_chat_logprobs_match_the_engines_and_stream_alike(chat_client, chat_server):
    kw = dict(model=chat_server.model, messages=MESSAGES, max_completion_tokens=12, temperature=0.8, seed=2,
              logprobs=True, top_logprobs=2)
    out = chat_client.chat.completions.create(**kw)
    local = zllm.Engine.from_config(chat_server.config)
    mine = local.generate({"messages": MESSAGES, "max_tokens": 12, "temperature": 0.8, "seed": 2, "logprobs": 2})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(mine["token_ids"])
    assert [c.token for c in content] == [e["token"] for e in mine["logprobs"]]
    assert [c.logprob for c in content] == pytest.approx([e["logprob"] for e in mine["logprobs"]], abs=1e-4)
    assert all(c.bytes == list(c.token.encode("utf-8")) and len(c.top_logprobs) == 2 for c in content)
    streamed = [t for c in chat_client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(c.token, c.logprob) for c in content]


@needs_messages
def test_chat_logprobs_without_top_logprobs_report_the_chosen_token_only(chat_client, chat_server):
    out = chat_client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=4,
                                              temperature=0, logprobs=True)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(c.top_logprobs == [] and c.logprob <= 0 for c in content)
    none = chat_client.chat.completions.create(model=chat_server.model, messages=MESSAGES, max_completion_tokens=4,
                                               temperature=0)
    assert none.choices[0].logprobs is None
