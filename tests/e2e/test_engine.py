"""zllm.Engine behaviour on the shipped model: streaming, stop rules, prefix reuse,
chunked prefill, interleaved sequences, sampling and context limits."""

from __future__ import annotations

import threading

import pytest
import torch

import zllm
from tests.conftest import CONFIGS, MODEL_DIR, REFERENCE_TEXT, write_config
from zllm.engine.engine import on_a_passing_thread
from zllm.spec.errors import ConfigError, ContextLengthError, RequestError


@pytest.fixture(scope="module")
def engine():
    return zllm.Engine.from_config(CONFIGS / "stories260k-hf.yaml")


def _engine(tmp_path, **runtime):
    return zllm.Engine.from_config(write_config(tmp_path, MODEL_DIR / "hf", runtime=runtime))


def _stream(engine, request):
    events = list(engine.generate_stream(request))
    final = events[-1]
    deltas = events[:-1]
    assert "finish_reason" in final and all("finish_reason" not in e for e in deltas)
    return "".join(e["text"] for e in deltas), [t for e in deltas for t in e["token_ids"]], final


@pytest.mark.parametrize("request_", [
    {"prompt": "", "max_tokens": 120},
    {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0.9, "top_p": 0.9, "seed": 7},
    {"prompt": "The dog", "max_tokens": 80, "temperature": 1.2, "top_k": 20, "min_p": 0.05, "seed": 3,
     "stop": ["park", "."]},
    {"prompt": "Lily", "max_tokens": 60, "repetition_penalty": 1.3, "presence_penalty": 0.5,
     "frequency_penalty": 0.5},
])
def test_stream_concatenation_equals_generate_text(engine, request_):
    full = engine.generate(request_)
    text, token_ids, final = _stream(engine, request_)
    assert text == full["text"]
    assert token_ids == full["token_ids"]
    assert final["finish_reason"] == full["finish_reason"]
    # the second run may reuse the first one's cached prompt; only cached_tokens differs
    assert {k: v for k, v in final["usage"].items() if k != "cached_tokens"} == {
        k: v for k, v in full["usage"].items() if k != "cached_tokens"}


def test_stop_string_spanning_tokens_ends_output_before_it(engine):
    stop = "little girl"  # several tokens in the 512-token vocabulary
    out = engine.generate({"prompt": "", "max_tokens": 100, "stop": [stop]})
    assert out["finish_reason"] == "stop"
    assert out["text"] == REFERENCE_TEXT[: REFERENCE_TEXT.index(stop)]
    text, _, _ = _stream(engine, {"prompt": "", "max_tokens": 100, "stop": [stop]})
    assert text == out["text"] and stop not in text


@pytest.mark.parametrize("stop", [" the", " the park", " park with"])
def test_the_stop_string_that_ended_generation_is_reported_even_with_the_first_tokens_space(engine, stop):
    # Greedy, " the park with her mom." follows; its first token is "▁the", whose space a
    # decode of the output tokens alone drops: the engine reports the string it cut at.
    request = {"prompt": "Lily went to", "max_tokens": 8, "temperature": 0}
    whole = engine.generate(request)["text"]
    assert whole.startswith(" the park with")
    out = engine.generate({**request, "stop": ["zzz", stop]})
    assert (out["text"], out["finish_reason"], out["stop_sequence"]) == (whole[: whole.index(stop)], "stop", stop)
    text, _, final = _stream(engine, {**request, "stop": ["zzz", stop]})
    assert (text, final["finish_reason"], final["stop_sequence"]) == (out["text"], "stop", stop)


def test_no_stop_string_is_reported_when_length_eos_or_a_stop_token_ends_generation(engine):
    first = engine.generate({"prompt": "", "max_tokens": 5})
    assert (first["finish_reason"], first["stop_sequence"]) == ("length", None)
    by_token = engine.generate({"prompt": "", "max_tokens": 50, "stop_token_ids": [first["token_ids"][3]],
                                "stop": ["zzz"]})
    assert (by_token["finish_reason"], by_token["stop_sequence"]) == ("stop", None)
    by_eos = engine.generate({"prompt": "", "max_tokens": 400, "stop": ["zzz"]})
    assert (by_eos["finish_reason"], by_eos["stop_sequence"]) == ("stop", None)


def test_stop_string_prefix_that_never_completes_is_released(engine):
    out = engine.generate({"prompt": "", "max_tokens": 30, "stop": ["little boy"]})
    assert out["finish_reason"] == "length"
    assert REFERENCE_TEXT.startswith(out["text"]) and "little" in out["text"]


def test_stop_token_ids_from_request_end_generation(engine):
    first = engine.generate({"prompt": "", "max_tokens": 5})["token_ids"]
    out = engine.generate({"prompt": "", "max_tokens": 50, "stop_token_ids": [first[3]]})
    assert out["finish_reason"] == "stop" and out["token_ids"] == first[:3]


def test_max_tokens_reports_length(engine):
    out = engine.generate({"prompt": "", "max_tokens": 7})
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 7


def test_seeded_sampling_is_reproducible_and_seed_sensitive(engine):
    req = {"prompt": "Once", "max_tokens": 40, "temperature": 1.0, "seed": 1234}
    a, b = engine.generate(req), engine.generate(req)
    c = engine.generate({**req, "seed": 4321})
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_prompt_longer_than_context_window_names_both_lengths(engine):
    with pytest.raises(ContextLengthError, match="600 tokens but the context window is 512"):
        engine.generate({"prompt_token_ids": [5] * 600, "max_tokens": 4})


def test_generation_reaching_context_window_ends_with_length(engine):
    out = engine.generate({"prompt_token_ids": [1] + [400] * 505, "max_tokens": 50, "stop_token_ids": []})
    assert out["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= 512


def test_invalid_request_field_is_named(engine):
    with pytest.raises(RequestError, match="temperature"):
        engine.generate({"prompt": "x", "temperature": -1})
    with pytest.raises(RequestError, match="prompt_token_ids"):
        engine.generate({"prompt_token_ids": [1, 99999]})


def test_append_prefill_reuses_cached_prefix_and_matches_fresh_run(tmp_path):
    cached = _engine(tmp_path, prefix_cache_seqs=4)
    first = cached.generate({"prompt": "", "max_tokens": 40})
    follow_up = [1] + first["token_ids"] + cached.tokenizer.encode(" Then", add_special_tokens=False)
    second = cached.generate({"prompt_token_ids": follow_up, "max_tokens": 30})
    assert second["usage"]["cached_tokens"] >= 40
    fresh = _engine(tmp_path, prefix_cache_seqs=0).generate({"prompt_token_ids": follow_up, "max_tokens": 30})
    assert fresh["usage"]["cached_tokens"] == 0
    assert second["token_ids"] == fresh["token_ids"]


def test_chunked_prefill_matches_single_prefill(tmp_path, engine):
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play"
    chunked = _engine(tmp_path, max_prefill_tokens=3).generate({"prompt": prompt, "max_tokens": 40})
    assert chunked["token_ids"] == engine.generate({"prompt": prompt, "max_tokens": 40})["token_ids"]


def test_interleaved_streams_decode_in_one_round_and_match_solo_runs(tmp_path, engine):
    both = _engine(tmp_path, max_num_seqs=4)
    reqs = [{"prompt": "", "max_tokens": 50}, {"prompt": "The cat", "max_tokens": 30, "temperature": 0.8, "seed": 5}]
    streams = [both.generate_stream(r) for r in reqs]
    texts = ["", ""]
    live = [True, True]
    while any(live):
        for i, s in enumerate(streams):
            if live[i]:
                event = next(s)
                if "finish_reason" in event:
                    live[i] = False
                else:
                    texts[i] += event["text"]
    assert texts == [engine.generate(r)["text"] for r in reqs]


def test_small_kv_cache_preempts_and_still_completes(tmp_path, engine):
    # 6 blocks x 16 tokens cannot hold two ~60-token sequences at once: one is preempted,
    # recomputed later, and both still produce what they produce alone.
    tight = zllm.Engine.from_config(write_config(
        tmp_path, MODEL_DIR / "hf", runtime={"kv_cache": {"num_blocks": 6, "block_size": 16}, "prefix_cache_seqs": 0}))
    reqs = [{"prompt": "", "max_tokens": 60}, {"prompt": "The dog", "max_tokens": 60}]
    streams = [tight.generate_stream(r) for r in reqs]
    texts = ["", ""]
    done = [False, False]
    while not all(done):
        for i, s in enumerate(streams):
            if not done[i]:
                event = next(s)
                done[i] = "finish_reason" in event
                texts[i] += event.get("text", "")
    assert texts == [engine.generate(r)["text"] for r in reqs]


def test_closing_a_stream_early_frees_its_kv_blocks(tmp_path):
    eng = _engine(tmp_path, prefix_cache_seqs=0)
    free_before = eng.llm.scheduler.kv.num_free_blocks
    stream = eng.generate_stream({"prompt": "", "max_tokens": 100})
    next(stream), next(stream)
    stream.close()
    assert eng.llm.scheduler.kv.num_free_blocks == free_before
    assert not eng.llm.has_work()


def test_ignore_eos_runs_past_the_story_separator(engine):
    stopped = engine.generate({"prompt": "", "max_tokens": 400})
    assert stopped["finish_reason"] == "stop"
    out = engine.generate({"prompt": "", "max_tokens": 400, "ignore_eos": True})
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 400
    assert out["token_ids"][: len(stopped["token_ids"])] == stopped["token_ids"]


def test_prompt_filling_the_whole_context_window_is_rejected(engine):
    with pytest.raises(ContextLengthError, match="512 tokens but the context window is 512 tokens and must leave room"):
        engine.generate({"prompt_token_ids": [1] + [400] * 511, "max_tokens": 4})
    out = engine.generate({"prompt_token_ids": [1] + [400] * 510, "max_tokens": 4, "stop_token_ids": []})
    assert out["usage"]["total_tokens"] == 512 and out["finish_reason"] == "length"


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_16_bit_kv_cache_stores_rounded_keys_and_keeps_the_greedy_story(tmp_path, engine, dtype):
    half = _engine(tmp_path, kv_cache={"dtype": dtype})
    kv = half.llm.runner.kv
    assert all(k.dtype == v.dtype == {"f16": torch.float16, "bf16": torch.bfloat16}[dtype] for k, v in kv.layers)
    f32 = engine.llm.runner.kv
    assert kv.num_blocks == f32.num_blocks and 2 * kv.layers[0][0].nbytes == f32.layers[0][0].nbytes
    request = {"prompt": "", "max_tokens": 120}
    assert half.generate(request)["token_ids"] == engine.generate(request)["token_ids"]
    ids = engine.tokenizer.encode("Once upon a time, there was a little girl named Lily")
    # keys/values rounded to 11 (f16) or 8 (bf16) significant bits; logits here are of order 10
    atol = {"f16": 2e-2, "bf16": 2e-1}[dtype]
    torch.testing.assert_close(half.prompt_logits(ids), engine.prompt_logits(ids), atol=atol, rtol=0)


def test_on_a_passing_thread_builds_on_a_thread_that_has_ended_and_reraises_its_error():
    # Engine.from_config builds through it so that loading leaves no OpenMP pool on the
    # caller's thread (libgomp frees a pool when its thread exits).
    ran_on: list[threading.Thread] = []
    assert on_a_passing_thread(lambda: ran_on.append(threading.current_thread()) or 7) == 7
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def fail():
        raise ConfigError("model.path", "no such directory")

    with pytest.raises(ConfigError, match="model.path: no such directory"):
        on_a_passing_thread(fail)
