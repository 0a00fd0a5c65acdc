"""DeepSeek-V3 multi-token prediction (``speculative: {method: mtp}``) is lossless and
computes what the paper describes.

transformers has no MTP layer and drops its tensors on save, so the test checkpoint is a
tiny transformers-saved ``deepseek_v3`` (MLA with q-LoRA, a dense then a MoE layer with
grouped routing) to which the nextn layer ``model.layers.2.*`` is added by hand with
DeepSeek-V3's names and shapes (a decoder layer like layer 1, ``enorm``, ``hnorm``,
``eh_proj [C, 2C]``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens``). With random
weights acceptance means nothing; what is checked:

- the MTP layer's output against a per-token f32 implementation of the paper's equations
  (§2.2, eq. 21-23) whose decoder block is transformers' own ``DeepseekV3DecoderLayer``, fed
  with the target's hidden states from transformers — prefilled at once and in chunks;
- every proposal the engine makes equals that reference's greedy chain over the sequence
  so far (its cache is in step after accepted and rejected runs, its speculative rows
  rolled back);
- greedy output with MTP speculation is token-identical to greedy output without
  (batch-invariant mode), for K in 1..4, in a mixed batch with sampling requests, under
  preemption, after a prefix-cache hit (the MTP cache restarts after the reused prefix) and
  under a JSON-schema grammar;
- a checkpoint without nextn layers is refused at load, naming the setting and the path
  (``zllm run``: one line, exit status 2); one with part of an MTP layer names the missing
  tensor.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import zllm
from tests.cli.conftest import one_line_error
from tests.cli.conftest import zllm as zllm_cli
from tests.concurrent_requests import run_together
from tests.conftest import copy_tokenizer, write_config
from zllm.capabilities.ops import AttentionMetadata
from zllm.runtime.kv_cache import PagedKVCache, SeqKV
from zllm.runtime.mtp import MtpProposer
from zllm.runtime.speculative import Proposal
from zllm.spec.errors import CheckpointError, ConfigError

CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    num_nextn_predict_layers=1, tie_word_embeddings=False,
)
NEXTN = "model.layers.2."
PROMPTS = ["Once upon a time", "The cat sat on the mat. The cat", "One day", "Lily and Ben went to the park."]


def _randomised(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A tensor shaped like ``t`` with its scale: norms near 1, matrices of ``t``'s spread."""
    if t.dim() == 1 and torch.all(t == 1):
        return 1 + 0.2 * torch.randn(t.shape, generator=g)
    return torch.randn(t.shape, generator=g) * max(float(t.float().std()), 0.05) + float(t.float().mean())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(hf model, path without MTP, path with the nextn layer added, the added tensors)``."""
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model("deepseek_v3", **CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is tiny: widen it so attention and routing matter
        for p in model.parameters():
            p.mul_(4.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    root = tmp_path_factory.mktemp("mtp")
    plain = root / "plain"
    model.save_pretrained(plain)
    copy_tokenizer(plain)

    tensors = load_file(plain / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    c = CONFIG["hidden_size"]
    nextn = {NEXTN + k[len("model.layers.1."):]: _randomised(v, g)
             for k, v in tensors.items() if k.startswith("model.layers.1.")}
    nextn |= {
        NEXTN + "enorm.weight": 1 + 0.2 * torch.randn(c, generator=g),
        NEXTN + "hnorm.weight": 1 + 0.2 * torch.randn(c, generator=g),
        NEXTN + "eh_proj.weight": torch.randn(c, 2 * c, generator=g) * (2 * c) ** -0.5 * 2,
        NEXTN + "shared_head.norm.weight": 1 + 0.2 * torch.randn(c, generator=g),
        NEXTN + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        NEXTN + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    with_mtp = root / "mtp"
    with_mtp.mkdir()
    save_file(tensors | nextn, with_mtp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and not any(k.startswith(NEXTN) for k in tensors)
    (with_mtp / "config.json").write_text(json.dumps(cfg))
    copy_tokenizer(with_mtp)
    return model, plain, with_mtp, nextn


def _config(tmp_path, path, k: int | None = None, **runtime):
    sections = {"runtime": {"batch_invariant": True, **runtime}}
    if k is not None:
        sections["speculative"] = {"method": "mtp", "num_tokens": k, "adaptive": False}
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_config(tmp_path, path, **sections)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = CONFIG["rms_norm_eps"]) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class ReferenceMtp:
    """DeepSeek-V3 §2.2 written out per token in f32: ``x_i = eh_proj [enorm(Emb t_{i+1}) ;
    hnorm(h_i)]`` one position at a time, the block ``TRM`` = transformers'
    ``DeepseekV3DecoderLayer`` (causal over positions ``0 .. i``), logits =
    ``head(shared_head.norm(g_i))``; ``h_i`` from transformers' model (after its final norm)."""

    def __init__(self, hf, nextn: dict[str, torch.Tensor]):
        self.hf = hf
        self.w = {k[len(NEXTN):]: v.float() for k, v in nextn.items()}
        self.block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(hf.config, 2)
        block_state = {k: v for k, v in self.w.items() if ".experts." not in k
                       and k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
        experts = range(CONFIG["n_routed_experts"])  # transformers keeps them fused in memory
        block_state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [self.w[f"mlp.experts.{x}.gate_proj.weight"], self.w[f"mlp.experts.{x}.up_proj.weight"]]) for x in experts])
        block_state["mlp.experts.down_proj"] = torch.stack(
            [self.w[f"mlp.experts.{x}.down_proj.weight"] for x in experts])
        missing, unexpected = self.block.load_state_dict(block_state, strict=False)
        assert not unexpected and all(m.endswith("e_score_correction_bias") for m in missing), (missing, unexpected)
        if missing:
            self.block.mlp.gate.e_score_correction_bias.copy_(self.w["mlp.gate.e_score_correction_bias"])
        self.block.eval()

    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """``[n, C]`` the main model's hidden states ``h_0 .. h_{n-1}``."""
        with torch.no_grad():
            return self.hf.model(torch.tensor([ids])).last_hidden_state[0].float()

    def outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """``g_0 .. g_{T-1}`` ``[T, C]`` for rows ``(tokens[i], hidden[i])`` at positions ``i``."""
        embed = self.hf.model.embed_tokens.weight.float()
        x = torch.stack([
            self.w["eh_proj.weight"] @ torch.cat([_rms(embed[t], self.w["enorm.weight"]),
                                                  _rms(h, self.w["hnorm.weight"])])
            for t, h in zip(tokens, hidden, strict=True)
        ])[None]  # [1, T, C]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]  # position i sees 0 .. i
        with torch.no_grad():
            out = self.block(x, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.hf.model.rotary_emb(x, positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return _rms(g, self.w["shared_head.norm.weight"]) @ self.w["shared_head.head.weight"].T

    def chain(self, ids: list[int], k: int) -> list[int]:
        """The greedy proposals after ``ids``: MTP over rows ``(t_{i+1}, h_i)``, then the layer
        again on its own output and each proposal."""
        hidden = self.target_hidden(ids)[:-1]  # h_0 .. h_{n-2}
        tokens = list(ids[1:])
        drafts: list[int] = []
        for _ in range(k):
            g = self.outputs(tokens, hidden)[-1]
            drafts.append(int(torch.argmax(self.logits(g)[:512])))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, g[None]])
        return drafts


def test_mtp_layer_matches_a_per_token_f32_implementation_of_the_paper(tmp_path, checkpoints):
    hf, _, path, nextn = checkpoints
    ref = ReferenceMtp(hf, nextn)
    ids = [1, 410, 469, 347, 30, 99, 280, 17, 401, 5, 77, 300, 12, 64, 201, 33, 90]
    hidden = ref.target_hidden(ids)[:-1]  # [n - 1, C]
    expected = ref.outputs(ids[1:], hidden)  # [n - 1, C]
    with zllm.Engine.from_config(_config(tmp_path, path, k=2)) as e:
        proposer = e.llm.proposer
        assert isinstance(proposer, MtpProposer)
        mtp = proposer.mtp
        kv = PagedKVCache(mtp.kv_spec, 16, 4)
        for chunks in ([len(hidden)], [5, 3, 1, 1, 1, 5]):  # one prefill; then chunks and single rows
            seq = SeqKV()
            got = []
            start = 0
            for n in chunks:
                slots = kv.append(seq, n)
                meta = AttentionMetadata(
                    slot_mapping=torch.tensor(slots), block_tables=kv.block_table([seq]), query_lens=(n,),
                    context_lens=(seq.num_tokens,), scale=kv.spec.attention_scale)
                rows = torch.arange(n)
                got.append(mtp.forward(torch.tensor(ids[start + 1: start + 1 + n]), hidden[start: start + n],
                                       torch.arange(start, start + n), meta, kv.layers, rows))
                start += n
            out = torch.cat(got)
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mtp.logits(out), ref.logits(expected), atol=1e-4, rtol=1e-4)
            kv.free(seq)


class Recording:
    """Records each proposal of the engine's MTP proposer with the tokens it followed, then
    proposes instead the known greedy continuation with every third token wrong, so that
    accepted runs of every length and rejections both happen (random MTP weights are
    almost never accepted) while the MTP layer follows the sequence."""

    name = "mtp"

    def __init__(self, inner: MtpProposer, continuation: dict[tuple[int, ...], list[int]]):
        self.inner, self.continuation = inner, continuation
        self.calls: list[tuple[list[int], int, list[int]]] = []

    def propose(self, seqs, ks):
        out = self.inner.propose(seqs, ks)
        self.calls += [(list(s.all_ids), k, p.tokens) for s, k, p in zip(seqs, ks, out, strict=True) if k]
        replayed = []
        for s, k in zip(seqs, ks, strict=True):
            at = len(s.output_ids)
            known = self.continuation.get(tuple(s.prompt_ids), [])[at: at + k]
            replayed.append(Proposal([t if (at + j) % 3 else (t + 1) % 512 for j, t in enumerate(known)]))
        return replayed

    def observe(self, rows):
        self.inner.observe(rows)

    def release(self, seq):
        self.inner.release(seq)


def test_every_proposal_is_the_papers_greedy_chain_over_the_sequence_so_far(tmp_path, checkpoints):
    hf, _, path, nextn = checkpoints
    ref = ReferenceMtp(hf, nextn)
    req = {"prompt": PROMPTS[1], "max_tokens": 24, "ignore_eos": True}
    with zllm.Engine.from_config(_config(tmp_path / "plain", path)) as p:
        prompt = p.prompt_ids(p.parse(req))
        continuation = {tuple(prompt): p.generate(req)["token_ids"]}
    with zllm.Engine.from_config(_config(tmp_path, path, k=3, kv_cache={"block_size": 4}, prefix_cache_seqs=0)) as e:
        recording = Recording(e.llm.proposer, continuation)
        e.loop.call(lambda llm: setattr(llm, "proposer", recording))
        assert e.generate(req)["token_ids"] == continuation[tuple(prompt)]
        e.generate({"prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3})
        accepted = e.llm.spec_stats.accepted
    assert len(recording.calls) > 8 and accepted[0] > 0 and accepted[1] > 0
    for ids, k, drafts in recording.calls:
        assert drafts == ref.chain(ids, k), ids


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, checkpoints):
    _, _, path, _ = checkpoints
    reqs = [{"prompt": p, "max_tokens": 30 + 4 * i, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    reqs += [{"prompt": p, "max_tokens": 20, "temperature": 0.8, "seed": i, "ignore_eos": True}
             for i, p in enumerate(PROMPTS[:2])]
    with zllm.Engine.from_config(_config(tmp_path_factory.mktemp("plain"), path)) as e:
        return reqs, [e.generate(r)["token_ids"] for r in reqs]


@pytest.mark.parametrize("k", range(1, 5))
def test_greedy_output_with_mtp_speculation_equals_greedy_output_without(tmp_path, checkpoints, plain_runs, k):
    _, _, path, _ = checkpoints
    reqs, expected = plain_runs
    with zllm.Engine.from_config(_config(tmp_path, path, k=k)) as e:
        results = dict(enumerate(run_together(e, reqs)))
        greedy = len(PROMPTS)
        assert [results[i] for i in range(greedy)] == expected[:greedy]
        stats = e.llm.spec_stats
        assert len(stats.proposed) == k and stats.steps > 0
        assert e.llm.scheduler.stats.max_decodes_per_step > 1  # the sequences shared steps
        assert e.loop.call(lambda llm: len(llm.proposer._tracks)) == 0  # every sequence's MTP cache freed
        assert e.llm.proposer.kv.num_free_blocks == e.llm.proposer.kv.num_blocks


def test_mtp_on_a_checkpoint_without_nextn_layers_is_refused_at_load(tmp_path, checkpoints):
    _, plain, _, _ = checkpoints
    with pytest.raises(ConfigError) as err:
        zllm.Engine.from_config(_config(tmp_path, plain, k=2))
    assert err.value.path == "speculative.method"
    assert str(plain) in str(err.value) and "multi-token-prediction" in str(err.value)
    proc = zllm_cli("run", "--config", _config(tmp_path / "cli", plain, k=2), "--max-new-tokens", "2")
    assert proc.returncode == 2
    line = one_line_error(proc)
    assert line.startswith("error: speculative.method: mtp needs") and str(plain) in line, line


def test_preemption_and_prefix_reuse_keep_greedy_output_and_the_mtp_cache_restarts(tmp_path, checkpoints,
                                                                                   plain_runs):
    _, _, path, _ = checkpoints
    reqs, expected = plain_runs
    greedy = reqs[: len(PROMPTS)]
    with zllm.Engine.from_config(_config(tmp_path / "tight", path, k=3, kv_cache={"num_blocks": 14, "block_size": 8},
                                         prefix_cache_seqs=0)) as e:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = e.generate(greedy[i])["token_ids"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(greedy))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert e.llm.scheduler.stats.preemptions > 0
        assert [results[i] for i in range(len(greedy))] == expected[: len(greedy)]
    follow = {"prompt": PROMPTS[0] + " and then", "max_tokens": 16, "ignore_eos": True}
    with zllm.Engine.from_config(_config(tmp_path / "plain", path)) as p:
        want = p.generate(follow)["token_ids"]
    with zllm.Engine.from_config(_config(tmp_path / "reuse", path, k=3, prefix_cache_seqs=2)) as e:
        e.generate({"prompt": PROMPTS[0] + " and then", "max_tokens": 1, "ignore_eos": True})
        steps = e.llm.spec_stats.steps
        again = e.generate(follow)
        assert again["usage"]["cached_tokens"] > 0 and again["token_ids"] == want
        assert e.llm.spec_stats.steps > steps  # proposals resumed over the rows after the reused prefix


def test_a_grammar_constrained_request_keeps_greedy_output_with_mtp(tmp_path, checkpoints):
    _, _, path, _ = checkpoints
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    req = {"prompt": PROMPTS[0], "max_tokens": 60,
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with zllm.Engine.from_config(_config(tmp_path / "plain", path)) as p:
        expected = p.generate(req)
    with zllm.Engine.from_config(_config(tmp_path / "mtp", path, k=3)) as e:
        got = e.generate(req)
        assert e.llm.spec_stats.proposed  # drafts the grammar allowed were verified
    assert got["token_ids"] == expected["token_ids"] and got["finish_reason"] == expected["finish_reason"]
    json.loads(got["text"])


def test_a_checkpoint_with_part_of_an_mtp_layer_is_refused_naming_the_missing_tensor(tmp_path, checkpoints):
    _, _, path, _ = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(path / "model.safetensors")
    del tensors[NEXTN + "eh_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    (broken / "config.json").write_text((path / "config.json").read_text())
    copy_tokenizer(broken)
    with pytest.raises(CheckpointError, match=r"the MTP layer lacks 'model\.layers\.2\.eh_proj\.weight'"):
        zllm.Engine.from_config(_config(tmp_path, broken))
