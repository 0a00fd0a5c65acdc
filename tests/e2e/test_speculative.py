"""Speculative decoding is lossless: with batch-invariant kernels, greedy output with
speculation is token-identical to greedy output without, whatever the proposer proposes,
for K in 1..8, in mixed batches, when a stop lands inside an accepted run, under
preemption, with a sliding window, and with prefix reuse; and after every rejection the
cache holds exactly what a run without speculation holds.

Besides the n-gram proposer, a test proposer replays the known greedy continuation with
errors injected at a set rate, so every K and every accept length is exercised.
"""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

import zllm
from tests.concurrent_requests import run_together
from tests.conftest import MODEL_DIR, copy_tokenizer, write_config
from zllm.runtime.speculative import NgramProposer, Proposal

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw a big "
         "red ball in the park. Once upon a time, there was a little girl named Lily. She loved to")
PROMPTS = [STORY, "The cat sat on the mat. The cat sat on the", "One day", "Lily and Ben went to the park. Lily and"]


class ReplayProposer:
    """Proposes the next tokens of a known continuation of each prompt, each one replaced by
    a wrong token with probability ``error_rate``: every accept length happens. The errors
    depend only on (seed, prompt, position), so a sequence gets the same proposals alone or
    in a batch."""

    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], error_rate: float, vocab: int, seed: int = 0):
        self.continuations, self.error_rate, self.vocab, self.seed = continuations, error_rate, vocab, seed

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            known = self.continuations.get(tuple(seq.prompt_ids), [])
            at = len(seq.output_ids)
            rng = random.Random(hash((self.seed, tuple(seq.prompt_ids), at)))
            out.append(Proposal([rng.randrange(self.vocab) if rng.random() < self.error_rate else t
                                 for t in known[at: at + k]]))
        return out

    def release(self, seq):
        pass


def _config(tmp_path, model=MODEL_DIR / "hf", k: int | None = None, adaptive: bool = False, **runtime):
    tmp_path.mkdir(parents=True, exist_ok=True)
    sections = {"runtime": {"batch_invariant": True, **runtime}}
    if k is not None:
        sections["speculative"] = {"method": "ngram", "num_tokens": k, "adaptive": adaptive}
    return write_config(tmp_path, model, **sections)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with zllm.Engine.from_config(_config(tmp_path_factory.mktemp("plain"))) as e:
        yield e


@pytest.fixture(scope="module")
def greedy_runs(plain):
    """Each prompt's greedy continuation without speculation (96 tokens, EOS ignored)."""
    return {p: plain.generate({"prompt": p, "max_tokens": 96, "ignore_eos": True})["token_ids"] for p in PROMPTS}


class TargetGreedyProposer:
    """Proposes the target model's own greedy continuation of each sequence (from another
    engine on the same checkpoint): likely tokens, so sampled requests accept many."""

    name = "target-greedy"

    def __init__(self, target):
        self.target = target

    def propose(self, seqs, ks):
        return [Proposal(self.target.generate({"prompt_token_ids": s.all_ids, "max_tokens": k,
                                               "ignore_eos": True})["token_ids"] if k else [])
                for s, k in zip(seqs, ks, strict=True)]

    def release(self, seq):
        pass


def _use_replay(engine, greedy_runs, error_rate: float, seed: int = 0) -> None:
    continuations = {tuple(engine.prompt_ids(engine.parse({"prompt": p}))): ids for p, ids in greedy_runs.items()}
    proposer = ReplayProposer(continuations, error_rate, engine.tokenizer.vocab_size, seed)
    engine.loop.call(lambda llm: setattr(llm, "proposer", proposer))


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_with_speculation_equals_greedy_output_without(tmp_path, greedy_runs, k):
    with zllm.Engine.from_config(_config(tmp_path, k=k)) as e:
        _use_replay(e, greedy_runs, error_rate=0.3, seed=k)
        for p, expected in greedy_runs.items():
            assert e.generate({"prompt": p, "max_tokens": 96, "ignore_eos": True})["token_ids"] == expected
        stats = e.llm.spec_stats
        assert stats.proposed and 0 < sum(stats.accepted) < sum(stats.proposed)  # accepts and rejections both ran
        assert len(stats.proposed) == k


def test_ngram_speculation_keeps_greedy_output_and_accepts_repeated_text(tmp_path, greedy_runs):
    with zllm.Engine.from_config(_config(tmp_path, k=4, adaptive=True)) as e:
        assert isinstance(e.llm.proposer, NgramProposer)
        for p, expected in greedy_runs.items():
            assert e.generate({"prompt": p, "max_tokens": 96, "ignore_eos": True})["token_ids"] == expected
        assert sum(e.llm.spec_stats.accepted) > 0


def test_mixed_batches_speculating_sampling_and_plain_sequences_match_their_runs_alone(tmp_path, greedy_runs):
    reqs = [{"prompt": p, "max_tokens": 60 + 5 * i, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    reqs += [{"prompt": p, "max_tokens": 40, "temperature": 0.9, "seed": i, "ignore_eos": True}
             for i, p in enumerate(PROMPTS[:2])]
    with zllm.Engine.from_config(_config(tmp_path, k=5)) as e:
        _use_replay(e, greedy_runs, error_rate=0.2)
        alone = [e.generate(r)["token_ids"] for r in reqs]
        results = dict(enumerate(run_together(e, reqs)))
        assert [results[i] for i in range(len(reqs))] == alone
        for r, ids in zip(reqs[: len(PROMPTS)], alone, strict=False):
            assert ids == greedy_runs[r["prompt"]][: r["max_tokens"]]


def test_a_stop_inside_an_accepted_run_keeps_nothing_after_it(tmp_path, plain, greedy_runs):
    ids = greedy_runs[STORY]
    stop_text = plain.tokenizer.decode(ids[10:13])
    req = {"prompt": STORY, "max_tokens": 96, "stop": [stop_text], "stop_token_ids": [ids[40]]}
    expected = plain.generate(req)
    streamed_plain = [ev["text"] for ev in plain.generate_stream(req) if ev["type"] == "delta"]
    with zllm.Engine.from_config(_config(tmp_path, k=8)) as e:
        _use_replay(e, greedy_runs, error_rate=0.0)
        got = e.generate(req)
        streamed = [ev["text"] for ev in e.generate_stream(req) if ev["type"] == "delta"]
        for max_tokens in (1, 7, 9):  # max_tokens inside a run of 8
            short = {"prompt": STORY, "max_tokens": max_tokens, "ignore_eos": True}
            assert e.generate(short)["token_ids"] == ids[:max_tokens]
        assert e.llm.scheduler.kv.num_free_blocks + e.llm.scheduler.prefix_cache.num_blocks == \
            e.llm.scheduler.kv.num_blocks
    assert (got["text"], got["token_ids"], got["finish_reason"]) == \
        (expected["text"], expected["token_ids"], expected["finish_reason"])
    assert "".join(streamed) == "".join(streamed_plain) == expected["text"]
    assert len(streamed) < len(streamed_plain)  # several tokens per delta


def test_after_every_rejection_the_cache_holds_what_a_run_without_speculation_holds(tmp_path, greedy_runs):
    def snapshots(e, prompt: str) -> dict[int, list[torch.Tensor]]:
        """After each step: cached tokens -> every layer's cached rows of them (the loop
        thread is stopped; the test steps the runtime itself)."""
        req = e.parse({"prompt": prompt, "max_tokens": 40, "ignore_eos": True})
        seq = e.llm.add_request(req, e.prompt_ids(req), 40)
        kv = e.llm.scheduler.kv
        out = {}
        while seq.finish_reason is None:
            e.llm.step()
            if seq.finish_reason is None:
                assert seq.kv.num_tokens == seq.num_tokens - 1  # nothing rejected stays cached
                slots = [seq.kv.blocks[p // kv.block_size] * kv.block_size + p % kv.block_size
                         for p in range(seq.kv.num_tokens)]
                out[seq.kv.num_tokens] = [t.flatten(0, 1)[slots].clone() for layer in kv.layers for t in layer]
        return out

    with zllm.Engine.from_config(_config(tmp_path / "a")) as ref_engine:
        ref_engine.loop.close()
        reference = snapshots(ref_engine, STORY)
    with zllm.Engine.from_config(_config(tmp_path / "b", k=6)) as e:
        _use_replay(e, greedy_runs, error_rate=0.4)
        e.loop.close()
        speculated = snapshots(e, STORY)
        assert 0 < sum(e.llm.spec_stats.accepted) < sum(e.llm.spec_stats.proposed)
    assert len(speculated) < len(reference)  # fewer steps
    for n, rows in speculated.items():
        assert all(torch.equal(a, b) for a, b in zip(reference[n], rows, strict=True)), n


def test_preemption_in_the_middle_of_runs_keeps_greedy_output(tmp_path, greedy_runs):
    reqs = [{"prompt": p, "max_tokens": 80, "ignore_eos": True} for p in PROMPTS]
    with zllm.Engine.from_config(_config(tmp_path, k=6, kv_cache={"num_blocks": 20, "block_size": 8},
                                         prefix_cache_seqs=0)) as e:
        _use_replay(e, greedy_runs, error_rate=0.25)
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = e.generate(reqs[i])["token_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert e.llm.scheduler.stats.preemptions > 0
        assert [results[i] for i in range(len(reqs))] == [greedy_runs[p][:80] for p in PROMPTS]


def test_a_later_request_reuses_the_prefix_cache_of_a_speculated_one(tmp_path, greedy_runs):
    with zllm.Engine.from_config(_config(tmp_path, k=4)) as e:
        _use_replay(e, greedy_runs, error_rate=0.3)
        first = e.generate({"prompt": STORY, "max_tokens": 30, "ignore_eos": True})
        follow = STORY + e.tokenizer.decode(first["token_ids"])
        again = e.generate({"prompt": follow, "max_tokens": 20, "ignore_eos": True})
    with zllm.Engine.from_config(_config(tmp_path / "plain")) as p:
        expected = p.generate({"prompt": follow, "max_tokens": 20, "ignore_eos": True})
    assert again["usage"]["cached_tokens"] > 0 and again["token_ids"] == expected["token_ids"]


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    """A random Mistral whose every layer slides over 12 tokens (transformers saves it)."""
    from transformers import MistralConfig, MistralForCausalLM

    dst = tmp_path_factory.mktemp("sliding") / "mistral"
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=12, tie_word_embeddings=False)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(dst, safe_serialization=True)
    copy_tokenizer(dst)
    return dst


def test_a_sliding_window_model_keeps_greedy_output_across_rollbacks(tmp_path, sliding_model):
    req = {"prompt": STORY, "max_tokens": 64, "ignore_eos": True}
    with zllm.Engine.from_config(_config(tmp_path / "plain", model=sliding_model, kv_cache={"block_size": 4})) as p:
        expected = p.generate(req)["token_ids"]
    with zllm.Engine.from_config(_config(tmp_path / "spec", model=sliding_model, k=5,
                                         kv_cache={"block_size": 4})) as e:
        assert e.llm.scheduler.kv.sliding_window == 12 and e.llm.scheduler.kv.eviction_lag == 5
        _use_replay(e, {STORY: expected}, error_rate=0.3)
        assert e.generate(req)["token_ids"] == expected
        assert sum(e.llm.spec_stats.accepted) > 0


def test_adaptive_lookahead_stops_proposing_for_a_proposer_that_is_always_wrong(tmp_path, greedy_runs):
    with zllm.Engine.from_config(_config(tmp_path, k=4, adaptive=True)) as e:
        _use_replay(e, greedy_runs, error_rate=1.0)
        out = e.generate({"prompt": STORY, "max_tokens": 96, "ignore_eos": True})
        assert out["token_ids"] == greedy_runs[STORY]
        stats = e.llm.spec_stats
        assert sum(stats.accepted) <= 2 and stats.steps < 40  # probes only, once the rate has fallen


def _homogeneity_chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the tokens seen (those expected < 5 times per
    sample pooled into one bin) and its degrees of freedom."""
    tokens = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in tokens], dtype=torch.float64)
    cb = torch.tensor([b.count(t) for t in tokens], dtype=torch.float64)
    rare = (ca + cb) / 2 < 5
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum()[None]])
        cb = torch.cat([cb[~rare], cb[rare].sum()[None]])
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    return float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum()), len(total) - 1


def _chi_square_critical(df: int, z: float = 3.719) -> float:
    """Chi-square's inverse CDF at 1 - 1e-4 (z = 3.719), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.slow
def test_sampled_tokens_with_speculation_are_distributed_as_without(tmp_path, plain, greedy_runs):
    """Over 1,500 seeds, the second and third sampled tokens (one verify step: the proposal's
    position and the bonus or correction after it) are distributed with speculation as
    without (two-sample chi-square, 1e-4 each)."""
    req = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 1.0, "top_k": 6, "ignore_eos": True}
    without = [plain.generate({**req, "seed": s})["token_ids"] for s in range(1500)]
    with zllm.Engine.from_config(_config(tmp_path, k=2)) as e:
        # Guesses the target likes (its greedy continuation of the actual prefix): many accepts and rejects.
        e.loop.call(lambda llm: setattr(llm, "proposer", TargetGreedyProposer(plain)))
        speculated = [e.generate({**req, "seed": s})["token_ids"] for s in range(1500)]
        stats = e.llm.spec_stats
        assert 0 < sum(stats.accepted) < sum(stats.proposed)
    for position in (1, 2):
        statistic, df = _homogeneity_chi_square([t[position] for t in without], [t[position] for t in speculated])
        assert statistic < _chi_square_critical(df), (position, statistic, df)


def test_greedy_prompt_lookup_matches_transformers_assisted_generation(tmp_path):
    """transformers' own prompt-lookup decoding (``prompt_lookup_num_tokens``) on the same
    checkpoint is an independent oracle: its greedy tokens equal zllm's with n-gram
    speculation (and both equal plain greedy decoding)."""
    from transformers import LlamaForCausalLM

    with zllm.Engine.from_config(_config(tmp_path, k=4, adaptive=False)) as e:
        ids = e.prompt_ids(e.parse({"prompt": STORY}))
        ours = e.generate({"prompt_token_ids": ids, "max_tokens": 48, "ignore_eos": True})["token_ids"]
        assert sum(e.llm.spec_stats.accepted) > 0
    model = LlamaForCausalLM.from_pretrained(MODEL_DIR / "hf", dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=48, min_new_tokens=48, prompt_lookup_num_tokens=4,
                             pad_token_id=0)
    assert out[0, len(ids):].tolist() == ours


def test_a_grammar_constrained_request_speculates_within_its_grammar(tmp_path, plain):
    """Each verify row is masked by the grammar after the proposals before it, and proposals
    are cut where the grammar stops allowing them: greedy JSON output is token-identical."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tags": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 4}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    req = {"prompt": STORY, "max_tokens": 80,
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    expected = plain.generate(req)
    with zllm.Engine.from_config(_config(tmp_path, k=4)) as e:
        _use_replay(e, {STORY: expected["token_ids"]}, error_rate=0.3)
        got = e.generate(req)
        stats = e.llm.spec_stats
        assert 0 < sum(stats.accepted) < sum(stats.proposed)
    assert got["token_ids"] == expected["token_ids"] and got["finish_reason"] == expected["finish_reason"] == "stop"
    json.loads(got["text"])


def test_an_mla_model_rolls_its_latent_cache_back_and_keeps_greedy_output(tmp_path):
    """DeepSeek-V3 (MLA latent cache, MoE): rejected proposals' latent rows are rolled back."""
    from tests.parity.test_deepseek_vs_transformers import _save

    _, path = _save(tmp_path, "v3-moe-grouped-bias-norm")
    req = {"prompt": STORY, "max_tokens": 48, "ignore_eos": True}
    with zllm.Engine.from_config(_config(tmp_path / "plain", model=path)) as p:
        expected = p.generate(req)["token_ids"]
    with zllm.Engine.from_config(_config(tmp_path / "spec", model=path, k=3)) as e:
        assert [t.name for t in e.llm.scheduler.kv.spec.layers[0].tensors] == ["latent"]
        _use_replay(e, {STORY: expected}, error_rate=0.35)
        assert e.generate(req)["token_ids"] == expected
        stats = e.llm.spec_stats
        assert 0 < sum(stats.accepted) < sum(stats.proposed)
