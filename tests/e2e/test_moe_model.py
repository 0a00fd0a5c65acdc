"""A MoE model (Qwen2-MoE: routed experts, a gated shared expert, a dense layer) runs through
the runtime with no special case: continuous batching in batch-invariant mode, prefix-cache
reuse, the HTTP server with the official OpenAI client; a backend without the ``moe``
capability is refused before a weight is read."""

from __future__ import annotations

import subprocess

import openai

import zllm
from tests.cli.conftest import ZLLM, assert_run_ends_with_one_error, put_nan_in_weight
from tests.concurrent_requests import run_together
from tests.conftest import write_config
from tests.parity.test_moe_vs_transformers import save_moe
from tests.server.conftest import start_server

CASE = "qwen2_moe-shared-dense-layer"
PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They", "One day", "A little bird"]


def _engine(tmp_path, path, **runtime):
    return zllm.Engine.from_config(write_config(tmp_path, path, runtime=runtime))


def test_concurrent_requests_in_batch_invariant_mode_equal_each_request_alone(tmp_path):
    _, path = save_moe(tmp_path, CASE)
    engine = _engine(tmp_path, path, batch_invariant=True, max_prefill_tokens=8, prefix_cache_seqs=0)
    assert {e.capability for e in engine.loaded.ops.explain()} >= {"moe[f32]"}
    reqs = [{"prompt": p, "max_tokens": 16 + 4 * i, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    together = run_together(engine, reqs)

    alone = [engine.generate(r)["token_ids"] for r in reqs]
    assert together == alone
    assert all(len(t) == r["max_tokens"] for t, r in zip(together, reqs, strict=True))


def test_prefix_cache_reuse_matches_a_fresh_run(tmp_path):
    _, path = save_moe(tmp_path, CASE)
    cached = _engine(tmp_path, path, prefix_cache_seqs=4)
    first = cached.generate({"prompt_token_ids": [1, 410, 469, 347], "max_tokens": 40, "ignore_eos": True})
    follow_up = [1, 410, 469, 347] + first["token_ids"] + [30, 99]
    second = cached.generate({"prompt_token_ids": follow_up, "max_tokens": 20, "ignore_eos": True})
    assert second["usage"]["cached_tokens"] >= 40
    fresh = _engine(tmp_path, path, prefix_cache_seqs=0).generate(
        {"prompt_token_ids": follow_up, "max_tokens": 20, "ignore_eos": True})
    assert second["token_ids"] == fresh["token_ids"]


def test_http_completions_with_the_openai_client_equal_the_engine(tmp_path):
    _, path = save_moe(tmp_path, CASE)
    expected = _engine(tmp_path, path, batch_invariant=True).generate(
        {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True})
    server = start_server(tmp_path, path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=path.name, prompt="Once upon a time", max_tokens=12,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected["text"]
        bad = client.with_options(max_retries=0)
        try:
            bad.completions.create(model=path.name, prompt="x", max_tokens=4, temperature=-1)
        except openai.BadRequestError as e:
            assert "temperature" in str(e)
        else:
            raise AssertionError("a negative temperature was accepted")
        assert server.healthy()
    finally:
        server.stop()


def test_a_backend_without_moe_is_refused_naming_the_capability_before_weights_are_read(tmp_path):
    _, path = save_moe(tmp_path, CASE)
    config = write_config(tmp_path, path)
    run = subprocess.run([*ZLLM, "run", "--config", str(config), "--backend", "metal",
                          "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "moe[f32]" in run.stderr and "metal" in run.stderr and "qwen2_moe" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_nan_in_the_router_weight_ends_zllm_run_with_one_error_line_and_exit_3(tmp_path):
    # Finding a NaN at load would read every mapped weight; the router sees it on the first
    # forward, the engine loop ends, and the command says so in one line (it printed a traceback).
    _, path = save_moe(tmp_path, CASE)
    put_nan_in_weight(path, "mlp.gate.weight")
    assert_run_ends_with_one_error(write_config(tmp_path, path), "router logits are not finite")
