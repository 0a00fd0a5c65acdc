"""Speculative decoding behind ``zllm serve``: streamed answers equal the server without
speculation token for token (several tokens per step still stream as whole characters,
with stop strings held back), usage counts generated tokens only, and ``/metrics`` reports
proposals and acceptances per draft position."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import MODEL_DIR
from tests.server.conftest import start_server

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time, there "
         "was a little girl named Lily. She")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-spec"), MODEL_DIR / "hf",
                       speculative={"method": "ngram", "num_tokens": 4, "adaptive": False})
    yield srv
    srv.stop()


def _stream(server, body: dict) -> tuple[str, list[str], dict]:
    pieces, usage = [], {}
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": server.model, "stream": True, "stream_options": {"include_usage": True},
                            **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(pieces), pieces, usage


@pytest.mark.parametrize("body", [
    {"prompt": STORY, "max_tokens": 80},
    {"prompt": STORY, "max_tokens": 80, "stop": [" Lily. She loved"]},
    {"prompt": "The cat sat on the mat. The cat sat on the", "max_tokens": 37},
])
def test_streamed_answers_with_speculation_equal_the_server_without(spec_server, server, body):
    text, pieces, usage = _stream(spec_server, body)
    expected, _, expected_usage = _stream(server, body)
    assert text == expected and "\ufffd" not in text
    assert usage["completion_tokens"] == expected_usage["completion_tokens"]


def test_metrics_report_proposals_and_acceptances_per_position(spec_server):
    before = spec_server.metrics()
    _stream(spec_server, {"prompt": STORY, "max_tokens": 60})
    after = spec_server.metrics()
    proposed = after['zllm_spec_proposed_tokens_total{position="0"}'] - before.get(
        'zllm_spec_proposed_tokens_total{position="0"}', 0)
    accepted = after['zllm_spec_accepted_tokens_total{position="0"}'] - before.get(
        'zllm_spec_accepted_tokens_total{position="0"}', 0)
    assert proposed > 0 and 0 < accepted <= proposed
    assert 'zllm_spec_proposed_tokens_total{position="3"}' in after
    assert 0 < after["zllm_spec_acceptance_rate"] <= 1
