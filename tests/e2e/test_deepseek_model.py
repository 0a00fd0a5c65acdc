"""A DeepSeek model (MLA with its latent KV cache, MoE with a shared expert, a leading dense
layer) runs through the runtime with no special case: sequences preempted under KV pressure
and recomputed give the tokens they give alone, and ``zllm serve`` answers completions,
streamed and not, with the tokens of ``zllm.Engine``."""

from __future__ import annotations

import openai
import pytest

import zllm
from tests.concurrent_requests import run_together
from tests.conftest import write_config
from tests.parity.test_deepseek_vs_transformers import _save
from tests.server.conftest import start_server

CASE = "v3-moe-grouped-bias-norm"  # sigmoid grouped routing, q_lora, one dense + one MoE layer
PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park. They", "One day", "A little bird",
           "Tom had a big"]


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    _, path = _save(tmp_path_factory.mktemp("deepseek"), CASE)
    return path


def _engine(tmp_path, path, **runtime):
    return zllm.Engine.from_config(write_config(tmp_path, path, runtime=runtime))


def test_preempted_sequences_give_the_tokens_they_give_alone(deepseek_dir, tmp_path):
    # 8 blocks x 16 tokens: six prompts fit at admission (one block each), but not the ~3-4
    # blocks each grows to, so running sequences are preempted (latent rows freed) and
    # recomputed later.
    engine = _engine(tmp_path, deepseek_dir, batch_invariant=True, kv_cache={"num_blocks": 8, "block_size": 16},
                     prefix_cache_seqs=0, max_num_seqs=8)
    reqs = [{"prompt": p, "max_tokens": 40, "ignore_eos": True} for p in PROMPTS]
    alone = [engine.generate(r)["token_ids"] for r in reqs]
    preemptions_before = engine.llm.scheduler.stats.preemptions
    together = run_together(engine, reqs)
    assert engine.llm.scheduler.stats.preemptions > preemptions_before
    assert together == alone and all(len(t) == 40 for t in together)
    assert engine.llm.scheduler.kv.num_free_blocks == 8


def test_http_completions_streamed_and_not_equal_the_engine(deepseek_dir, tmp_path):
    expected = _engine(tmp_path, deepseek_dir, batch_invariant=True).generate(
        {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True})
    assert expected["usage"]["completion_tokens"] == 16
    (tmp_path / "server").mkdir()
    server = start_server(tmp_path / "server", deepseek_dir, plugins="cpu,deepseek")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        args = dict(model=deepseek_dir.name, prompt="Once upon a time", max_tokens=16,
                    extra_body={"ignore_eos": True})
        out = client.completions.create(**args)
        assert out.choices[0].text == expected["text"]
        assert out.usage.completion_tokens == 16
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**args, stream=True)
                           if chunk.choices)
        assert streamed == expected["text"]
        assert server.healthy()
    finally:
        server.stop()
