"""/v1/completions, /v1/models, /health and /metrics through the official openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import REFERENCE_TEXT


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_greedy_completion_from_bos_is_the_reference_text(client, server):
    out = client.completions.create(model=server.model, prompt="", max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == server.model
    assert choice.finish_reason == "length" and choice.index == 0
    assert len(choice.text) > 100 and REFERENCE_TEXT.startswith(choice.text)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (1, 40, 41)


def test_prompt_as_token_ids_equals_prompt_as_text(client, server):
    # encode("Once upon a time") with its BOS (id 1): the same prompt given as ids
    ids = [1, 403, 407, 261, 378]
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    by_text = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stream_concatenates_to_the_non_streamed_text_with_usage_last(client, server):
    whole = client.completions.create(model=server.model, prompt="Once", max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=server.model, prompt="Once", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    body = {"model": server.model, "prompt": "Once", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert not any('"usage"' in line for line in lines)


def test_stop_string_ends_with_finish_reason_stop(client, server):
    out = client.completions.create(model=server.model, prompt="", max_tokens=100, temperature=0, stop=["Lily"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == REFERENCE_TEXT[: REFERENCE_TEXT.index("Lily")]


def test_seeded_sampling_is_reproducible(client, server):
    kw = dict(model=server.model, prompt="Once", max_tokens=16, temperature=1.0, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_http_and_in_process_engine_give_the_same_tokens_for_the_same_seed(client, server, tmp_path):
    import zllm
    from tests.conftest import MODEL_DIR, write_config

    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 11}
    http = client.completions.create(model=server.model, prompt="Once", max_tokens=24,
                                     extra_body={"top_k": 40}, **sampling)
    engine = zllm.Engine.from_config(write_config(
        tmp_path, MODEL_DIR / "hf", runtime={"batch_invariant": True, "max_num_seqs": 16}))
    local = engine.generate({"prompt": "Once", "max_tokens": 24, "top_k": 40, **sampling})
    assert http.choices[0].text == local["text"]
    assert http.usage.completion_tokens == local["usage"]["completion_tokens"]


def test_metrics_count_requests_tokens_and_latencies(client, server):
    before = server.metrics()
    key = 'zllm_requests_total{route="/v1/completions",status="200"}'
    client.completions.create(model=server.model, prompt="Once", max_tokens=5, temperature=0)
    after = server.metrics()
    assert after[key] == before.get(key, 0) + 1
    assert after["zllm_generation_tokens_total"] == before["zllm_generation_tokens_total"] + 5
    assert after["zllm_prompt_tokens_total"] > before["zllm_prompt_tokens_total"]
    assert after["zllm_time_to_first_token_seconds_count"] == before["zllm_time_to_first_token_seconds_count"] + 1
    assert after["zllm_inter_token_latency_seconds_count"] == before["zllm_inter_token_latency_seconds_count"] + 4
    assert after["zllm_num_requests_running"] == 0 and after["zllm_num_requests_waiting"] == 0
    assert after["zllm_kv_blocks_free"] + after["zllm_kv_blocks_used"] > 0
    assert after['zllm_requests_total{route="/health",status="200"}'] >= 1


def test_openapi_document_describes_every_route(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models"):
        assert path in doc["paths"], path
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
