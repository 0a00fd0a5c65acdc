"""server.request_timeout_s: a request that runs out of time is aborted, its KV blocks go
back to the pool, the client gets a 408 (or a last error event when streaming), and the
server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import MODEL_DIR
from tests.server.conftest import start_server

# A prompt no other request shares, so the prefix cache lends the request nothing and the
# free-block count must come back to exactly its idle value.
LONG = {"prompt": "Zebra umbrella quietly", "max_tokens": 480, "temperature": 0}


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("timeout"), MODEL_DIR / "hf",
                       server={"request_timeout_s": 0.05}, runtime={"prefix_cache_seqs": 0})
    yield srv
    srv.stop()


def _idle(srv) -> dict[str, float]:
    m = srv.metrics()
    assert m["zllm_num_requests_running"] == 0
    return m


def test_non_streamed_request_past_its_timeout_gets_408_in_openai_shape(slow_server):
    idle = _idle(slow_server)
    r = httpx.post(f"{slow_server.url}/v1/completions", json={**LONG, "model": slow_server.model}, timeout=60)
    assert r.status_code == 408
    err = r.json()["error"]
    assert err["code"] == "timeout" and "server.request_timeout_s" in err["message"]
    after = _idle(slow_server)
    assert after["zllm_kv_blocks_running"] == 0
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]
    assert slow_server.healthy()


def test_streamed_request_past_its_timeout_ends_with_an_error_event_and_frees_kv(slow_server):
    idle = _idle(slow_server)
    body = {**LONG, "model": slow_server.model, "stream": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(data[-1])
    assert last["error"]["code"] == "timeout"
    after = _idle(slow_server)
    assert after["zllm_kv_blocks_free"] == idle["zllm_kv_blocks_free"]

