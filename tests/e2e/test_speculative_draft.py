"""Draft-model speculation (``speculative.method: draft``) on real checkpoints: stories260K
(trained) as the target, drafted by itself (every greedy proposal is right) and by a random
Llama that transformers saved with the same tokenizer and a padded vocabulary (almost every
proposal is wrong). Greedy output is token-identical to greedy output without speculation
(batch-invariant mode) and to transformers' assisted generation; seeded sampling is
reproducible; a draft with another tokenizer or a shorter context is refused at load.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

import zllm
from tests.concurrent_requests import run_together
from tests.conftest import MODEL_DIR, copy_tokenizer
from tests.e2e.test_speculative import _chi_square_critical as chi_square_critical
from tests.e2e.test_speculative import _homogeneity_chi_square as homogeneity_chi_square
from zllm.runtime.draft import DraftProposer, common_prefix
from zllm.runtime.kv_cache import PagedKVCache
from zllm.runtime.runner import ModelRunner
from zllm.runtime.speculative import Proposal
from zllm.spec.errors import ConfigError

TARGET = MODEL_DIR / "hf"
PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to", "The cat sat on the mat.",
           "One day", "Lily and Ben went to the park. Lily and"]


def _random_llama(path, seed: int, vocab_size: int = 576, context: int = 512):
    """A random 2-layer Llama saved by transformers with the stories260K tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    copy_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def hot_draft(tmp_path_factory):
    """stories260K with its output head halved: its logits are the target's over 2, so at any
    sampling settings it proposes from a flatter distribution over the same ranking
    (accepts and rejections both happen, and ``q`` differs from ``p``)."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("hot_draft") / "llama"
    model = LlamaForCausalLM.from_pretrained(TARGET).eval()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 0.5)
    model.save_pretrained(path, safe_serialization=True)
    copy_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """An unrelated draft whose logits are padded past the 512 tokens (576 columns)."""
    path = tmp_path_factory.mktemp("random_draft") / "llama"
    _random_llama(path, seed=1)
    return path


def _config(draft=None, k: int = 4, adaptive: bool = False, **runtime):
    cfg = {"model": {"path": str(TARGET)}, "backend": {"name": "cpu"},
           "runtime": {"batch_invariant": True, **runtime}}
    if draft is not None:
        cfg["speculative"] = {"method": "draft", "num_tokens": k, "adaptive": adaptive,
                              "draft": {"model": {"path": str(draft)}}}
    return cfg


def _greedy(prompt: str, n: int = 64) -> dict:
    return {"prompt": prompt, "max_tokens": n, "ignore_eos": True}


@pytest.fixture(scope="module")
def greedy_runs():
    """Each prompt's greedy continuation without speculation."""
    with zllm.Engine.from_config(_config()) as e:
        return {p: e.generate(_greedy(p))["token_ids"] for p in PROMPTS}


def _all_draft_blocks_free(engine) -> bool:
    proposer = engine.llm.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_target_drafting_for_itself_accepts_every_greedy_proposal_and_keeps_the_output(greedy_runs, k):
    with zllm.Engine.from_config(_config(TARGET, k=k)) as e:
        for p, expected in greedy_runs.items():
            assert e.generate(_greedy(p))["token_ids"] == expected
        stats = e.llm.spec_stats
        assert len(stats.proposed) == k and stats.acceptance_rate == 1.0
        assert _all_draft_blocks_free(e)


def test_an_unrelated_random_draft_is_rejected_almost_always_and_keeps_the_output(greedy_runs, random_draft):
    with zllm.Engine.from_config(_config(random_draft, k=4)) as e:
        for p, expected in greedy_runs.items():
            assert e.generate(_greedy(p))["token_ids"] == expected
        rate = e.llm.spec_stats.acceptance_rate
        assert rate is not None and rate < 0.2
        assert _all_draft_blocks_free(e)


class RecordingProposer:
    """Passes every call to a draft proposer and keeps, for each sequence, the tokens it saw
    and the tokens proposed after them."""

    name = "draft"

    def __init__(self, inner: DraftProposer):
        self.inner = inner
        self.calls: list[tuple[list[int], Proposal]] = []
        self.unanswered = 0  # sequences asked for tokens that got none
        self.most_evicted = 0  # the most blocks a sliding window had freed from one sequence's draft cache

    def propose(self, seqs, ks):
        proposals = self.inner.propose(seqs, ks)
        self.calls += [(s.all_ids, p) for s, p in zip(seqs, proposals, strict=True) if p.tokens]
        self.unanswered += sum(1 for p, k in zip(proposals, ks, strict=True) if k and not p.tokens)
        self.most_evicted = max([self.most_evicted, *(h.num_evicted for h in self.inner._handles.values())])
        return proposals

    def release(self, seq):
        self.inner.release(seq)


def test_after_rejections_and_in_batches_the_draft_proposes_what_it_would_from_scratch(random_draft):
    """The draft's lazily synchronised cache holds exactly each sequence's tokens: every
    proposal equals the draft model's own greedy continuation of those tokens, computed alone."""
    with zllm.Engine.from_config(_config(random_draft, k=4)) as e:
        recorder = RecordingProposer(e.llm.proposer)
        e.loop.call(lambda llm: setattr(llm, "proposer", recorder))
        threads = [threading.Thread(target=e.generate, args=(_greedy(p, 40),)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert e.llm.scheduler.stats.max_decodes_per_step > 1
        stats = e.llm.spec_stats
        assert sum(stats.accepted) < sum(stats.proposed)  # rejections happened
        assert recorder.unanswered == 0
    with zllm.Engine.from_config({**_config(), "model": {"path": str(random_draft)}}) as draft:
        for ids, proposed in recorder.calls:
            alone = draft.generate({"prompt_token_ids": ids, "max_tokens": len(proposed.tokens), "ignore_eos": True})
            assert alone["token_ids"] == proposed.tokens and proposed.q is None
    assert len(recorder.calls) > 4 * 20


def test_a_sampled_proposal_carries_the_draft_distribution_it_was_drawn_from(hot_draft):
    """``q`` of each sampled proposal is the draft's softmax over its top-k logits at the
    request's temperature, after the sequence's tokens and the proposals before it."""
    temperature, top_k = 0.7, 20
    with zllm.Engine.from_config(_config(hot_draft, k=3)) as e:
        recorder = RecordingProposer(e.llm.proposer)
        e.loop.call(lambda llm: setattr(llm, "proposer", recorder))
        for seed in range(3):
            e.generate({"prompt": PROMPTS[seed], "max_tokens": 12, "temperature": temperature, "top_k": top_k,
                        "seed": seed, "ignore_eos": True})
    assert len(recorder.calls) >= 6
    with zllm.Engine.from_config({**_config(), "model": {"path": str(hot_draft)}}) as draft:
        for ids, proposed in recorder.calls:
            assert proposed.q is not None and proposed.q.shape == (len(proposed.tokens), 512)
            for j, token in enumerate(proposed.tokens):
                logits = draft.prompt_logits(ids + proposed.tokens[:j])[-1, :512] / temperature
                kept = logits >= logits.topk(top_k).values[-1]
                expected = torch.where(kept, logits, -torch.inf).softmax(-1)
                torch.testing.assert_close(proposed.q[j], expected, atol=1e-5, rtol=1e-4)
                assert kept[token]


def test_a_sampled_proposal_under_a_grammar_is_verified_as_one_hot(hot_draft):
    with zllm.Engine.from_config(_config(hot_draft, k=3)) as e:
        recorder = RecordingProposer(e.llm.proposer)
        e.loop.call(lambda llm: setattr(llm, "proposer", recorder))
        out = e.generate({"prompt": "The little dog", "max_tokens": 40, "temperature": 0.8, "seed": 1,
                          "response_format": {"type": "regex", "regex": "[a-z ]+\\."}})
        assert out["text"][-1] == "." and recorder.calls
        assert all(p.q is None for _, p in recorder.calls)


def _run_together(engine, reqs: list[dict]) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = engine.generate(reqs[i])["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [results[i] for i in range(len(reqs))]


def test_a_sliding_window_draft_rolls_back_within_its_window(tmp_path, greedy_runs):
    """A Mistral draft whose every layer slides over 12 tokens (its cache frees old blocks):
    its proposals still equal its own continuation computed alone."""
    from transformers import MistralConfig, MistralForCausalLM

    draft = tmp_path / "mistral"
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     sliding_window=12, tie_word_embeddings=False)
                       ).save_pretrained(draft, safe_serialization=True)
    copy_tokenizer(draft)
    with zllm.Engine.from_config(_config(draft, k=5, kv_cache={"block_size": 4})) as e:
        assert e.llm.proposer.kv.sliding_window == 12
        recorder = RecordingProposer(e.llm.proposer)
        e.loop.call(lambda llm: setattr(llm, "proposer", recorder))
        assert _run_together(e, [_greedy(p, 48) for p in PROMPTS]) == [greedy_runs[p][:48] for p in PROMPTS]
        assert recorder.most_evicted > 0 and recorder.unanswered == 0
    with zllm.Engine.from_config({**_config(kv_cache={"block_size": 4}), "model": {"path": str(draft)}}) as alone:
        for ids, proposed in recorder.calls:
            assert alone.generate({"prompt_token_ids": ids, "max_tokens": len(proposed.tokens),
                                   "ignore_eos": True})["token_ids"] == proposed.tokens


def test_a_draft_cache_too_small_for_every_sequence_proposes_for_those_it_holds(greedy_runs):
    """A draft whose cache holds about two of four sequences: the others get no proposals
    in the steps it cannot hold them, and every output stays the greedy one."""
    with zllm.Engine.from_config(_config(TARGET, k=4)) as e:
        big = e.llm.proposer
        small = PagedKVCache(big.kv.spec, 12, big.kv.block_size, device=big.runner.device)
        proposer = RecordingProposer(DraftProposer(ModelRunner(big.runner.model, big.runner.ops, small,
                                                               big.runner.device, True, big.runner.sample_width)))
        e.loop.call(lambda llm: setattr(llm, "proposer", proposer))
        assert _run_together(e, [_greedy(p, 60) for p in PROMPTS]) == [greedy_runs[p][:60] for p in PROMPTS]
        assert e.llm.spec_stats.acceptance_rate == 1.0  # whatever it proposed was right
        assert proposer.unanswered > 0 and proposer.calls
        assert small.num_free_blocks == small.num_blocks


def test_adaptive_lookahead_stops_drafting_with_a_draft_that_is_always_wrong(greedy_runs, random_draft):
    with zllm.Engine.from_config(_config(random_draft, k=4, adaptive=True)) as e:
        assert e.generate(_greedy(PROMPTS[0], 96))["token_ids"][:64] == greedy_runs[PROMPTS[0]]
        assert e.llm.spec_stats.steps < 40  # probes only, once the rate has fallen


def test_greedy_draft_speculation_equals_transformers_assisted_generation(tmp_path):
    from transformers import LlamaForCausalLM

    unpadded = tmp_path / "draft"  # transformers asks for both tokenizers when vocabulary sizes differ
    _random_llama(unpadded, seed=5, vocab_size=512)
    target = LlamaForCausalLM.from_pretrained(TARGET).eval()
    for draft_path in (TARGET, unpadded):
        assistant = LlamaForCausalLM.from_pretrained(draft_path).eval()
        with zllm.Engine.from_config(_config(draft_path, k=4)) as e:
            for p in PROMPTS[:2]:
                ids = e.prompt_ids(e.parse({"prompt": p}))
                with torch.no_grad():
                    hf = target.generate(torch.tensor([ids]), assistant_model=assistant, max_new_tokens=40,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
                assert e.generate(_greedy(p, 40))["token_ids"] == hf[0, len(ids):].tolist()


def test_a_seeded_sampled_request_with_a_draft_is_reproducible(random_draft):
    req = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": True}
    for draft_path in (TARGET, random_draft):
        with zllm.Engine.from_config(_config(draft_path, k=4)) as e:
            first = e.generate(req)["token_ids"]
            assert e.generate(req)["token_ids"] == first
            assert e.generate({**req, "seed": 8})["token_ids"] != first
            assert sum(e.llm.spec_stats.proposed) > 0
        with zllm.Engine.from_config(_config(draft_path, k=4)) as fresh:
            assert fresh.generate(req)["token_ids"] == first


@pytest.mark.slow
def test_sampled_tokens_with_a_draft_are_distributed_as_without(hot_draft):
    """Over 1,500 seeds, the second and third sampled tokens (one verify step of a proposal
    drawn from the draft's flatter distribution: accepted with probability min(1, p/q), else
    redrawn from the residual) are distributed as without speculation (two-sample
    chi-square, 1e-4 each)."""
    req = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 1.0, "top_k": 6, "ignore_eos": True}
    with zllm.Engine.from_config(_config()) as plain:
        without = [plain.generate({**req, "seed": s})["token_ids"] for s in range(1500)]
    with zllm.Engine.from_config(_config(hot_draft, k=2)) as e:
        speculated = [e.generate({**req, "seed": s})["token_ids"] for s in range(1500)]
        rate = e.llm.spec_stats.acceptance_rate
        assert rate is not None and 0.5 < rate < 0.95
    for position in (1, 2):
        statistic, df = homogeneity_chi_square([t[position] for t in without], [t[position] for t in speculated])
        assert statistic < chi_square_critical(df), (position, statistic, df)


@pytest.mark.parametrize("draft", ["target", "random"])
def test_mixed_batches_of_greedy_and_sampled_requests_match_their_runs_alone(greedy_runs, random_draft, draft):
    reqs = [_greedy(p, 40 + 5 * i) for i, p in enumerate(PROMPTS)]
    reqs += [{"prompt": p, "max_tokens": 32, "temperature": 0.9, "seed": i, "ignore_eos": True}
             for i, p in enumerate(PROMPTS[:2])]
    reqs.append({**_greedy(PROMPTS[1], 24), "repetition_penalty": 1.3})
    with zllm.Engine.from_config(_config(TARGET if draft == "target" else random_draft, k=3)) as e:
        alone = [e.generate(r)["token_ids"] for r in reqs]
        results = dict(enumerate(run_together(e, reqs)))
        assert [results[i] for i in range(len(reqs))] == alone
        assert e.llm.scheduler.stats.max_decodes_per_step > 1
        assert _all_draft_blocks_free(e)
    for r, ids in zip(reqs[: len(PROMPTS)], alone, strict=False):
        assert ids == greedy_runs[r["prompt"]][: r["max_tokens"]]


def test_preemption_keeps_greedy_output_with_a_draft(greedy_runs):
    reqs = [_greedy(p, 60) for p in PROMPTS]
    with zllm.Engine.from_config(_config(TARGET, k=4, kv_cache={"num_blocks": 20, "block_size": 8},
                                         prefix_cache_seqs=0)) as e:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = e.generate(reqs[i])["token_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert e.llm.scheduler.stats.preemptions > 0
        assert [results[i] for i in range(len(reqs))] == [greedy_runs[p][:60] for p in PROMPTS]
        assert _all_draft_blocks_free(e)


def test_a_draft_with_another_tokenizer_is_refused_naming_both_checkpoints(tmp_path):
    draft = tmp_path / "other_tokens"
    _random_llama(draft, seed=2, vocab_size=512)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[a], vocab[b] = 301, 300  # the same tokens, two of them numbered the other way round
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError) as err:
        zllm.Engine.from_config(_config(draft))
    assert err.value.path == "speculative.draft.model.path"
    assert "token id 300" in str(err.value) and str(draft) in str(err.value) and str(TARGET) in str(err.value)


def test_a_draft_with_a_smaller_vocabulary_is_refused(tmp_path):
    draft = tmp_path / "small_vocab"
    _random_llama(draft, seed=3, vocab_size=512)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < 500}
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if "".join(m) in vocab]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError) as err:
        zllm.Engine.from_config(_config(draft))
    assert err.value.path == "speculative.draft.model.path" and "fewer than the target's 512" in str(err.value)


def test_a_draft_with_a_shorter_context_is_refused_naming_the_setting(tmp_path):
    draft = tmp_path / "short"
    _random_llama(draft, seed=4, context=256)
    with pytest.raises(ConfigError) as err:
        zllm.Engine.from_config(_config(draft))
    assert err.value.path == "speculative.draft.model.path"
    assert "256" in str(err.value) and "runtime.context_length" in str(err.value)
    with zllm.Engine.from_config(_config(draft, context_length=256)) as e:  # the fix the message names
        assert len(e.generate(_greedy("One day", 8))["token_ids"]) == 8


def test_common_prefix_finds_the_first_difference():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
