"""deepseek_v2 / deepseek_v3 (MLA, dense and MoE layers) match HF transformers on tiny random
checkpoints that transformers saves (``save_pretrained``'s files: per-expert tensors, the hub
layout); GGUF files written from them with the ``gguf`` package (one ``attn_kv_b``, or the
split ``attn_k_b`` + ``attn_v_b`` llama.cpp's converter writes now) give the same tokens.

Tolerances: f32 -> last-position logits within 1e-4 relative of HF (all positions within
1e-4 absolute), 32 greedy tokens identical to ``generate(do_sample=False)``, cached latent
rows within 1e-4 of transformers' cache.
"""

from __future__ import annotations

import json
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache

import zllm
from tests.conftest import MODEL_DIR, copy_tokenizer, write_config
from zllm.spec.errors import ZllmError

VOCAB = 512  # the stories260K tokenizer
PROMPT = [1, 410, 469, 347, 30, 99, 280, 17, 401, 5, 77, 300, 12, 64, 201]
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
DENSE = dict(first_k_dense_replace=2)  # every layer dense: no MoE layer

# case -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-q_proj-dense": ("deepseek_v2", dict(DENSE)),
    "v2-q_lora-yarn-dense": (
        "deepseek_v2",
        dict(
            DENSE,
            q_lora_rank=24,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        ),
    ),
    "v3-q_lora-yarn-mscale-dense": (
        "deepseek_v3",
        dict(
            DENSE,
            q_lora_rank=24,
            num_hidden_layers=3,
            first_k_dense_replace=3,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
    ),
    # DeepSeek-V3's own setting (mscale == mscale_all_dim): what a GGUF file can express
    "v3-yarn-mscale-1-dense": (
        "deepseek_v3",
        dict(DENSE, q_lora_rank=24, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    "v2-moe-greedy-shared-scaled": (
        "deepseek_v2",
        dict(first_k_dense_replace=1, routed_scaling_factor=1.5),
    ),
    "v3-moe-grouped-bias-norm": (
        "deepseek_v3",
        dict(
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
        ),
    ),
    "v3-halves-bias-dense": (
        "deepseek_v3",
        dict(DENSE, rope_interleave=False, attention_bias=True, q_lora_rank=24),
    ),
}


def _save(tmp_path, case: str, cases=CASES):
    model_type, overrides = cases[case]
    torch.manual_seed(sum(map(ord, case)))
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Random init has tiny weights; widen them so the test sees real attention and routing.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer the choice
                buf.copy_(torch.randn(buf.shape) * 0.1)
    path = tmp_path / case
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model, path


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model, prompt=PROMPT, n=32):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _generate(engine, prompt=PROMPT, n=32):
    return engine.generate(
        {"prompt_token_ids": prompt, "max_tokens": n, "stop_token_ids": [], "ignore_eos": True}
    )


def _check_logits(ours: torch.Tensor, hf: torch.Tensor) -> None:
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=0)
    last_rel = ((ours[-1] - hf[-1]).abs().max() / hf[-1].abs().max()).item()
    assert last_rel < 1e-4, last_rel


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_logits_and_greedy_tokens_match_transformers(tmp_path, case):
    model, path = _save(tmp_path, case)
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    assert engine.loaded.family_info.name == "deepseek"
    _check_logits(engine.prompt_logits(PROMPT), _hf_logits(model, PROMPT))
    assert _generate(engine)["token_ids"] == _hf_greedy(model)


def _cached_rows(engine, seq, layer: int) -> torch.Tensor:
    """The latent rows ``[L, W]`` zllm cached for ``seq`` in ``layer``."""
    cache = engine.llm.scheduler.kv.layers[layer][0]  # [NB, BS, 1, W]
    blocks = torch.tensor([b for b in seq.kv.blocks if b >= 0])
    return cache[blocks].reshape(-1, cache.shape[-1])[: seq.kv.num_tokens].float()


@pytest.mark.parametrize(
    "case", ["v2-q_lora-yarn-dense", "v3-q_lora-yarn-mscale-dense", "v3-halves-bias-dense"]
)
def test_cached_latent_rows_equal_transformers_cache(tmp_path, case):
    model, path = _save(tmp_path, case)
    hf_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache=hf_cache, use_cache=True)
    engine = zllm.Engine.from_config(
        write_config(tmp_path, path, runtime={"kv_cache": {"block_size": 4}})
    )
    seq = engine.llm.add_request(
        engine.parse({"prompt_token_ids": PROMPT, "max_tokens": 2}), PROMPT, 2
    )
    engine.llm.step()  # the New Prefill of the whole prompt
    assert seq.kv.num_tokens == len(PROMPT)
    r = model.config.kv_lora_rank
    interleaved_v3 = model.config.model_type == "deepseek_v3" and model.config.rope_interleave
    for layer in range(model.config.num_hidden_layers):
        rows = _cached_rows(engine, seq, layer)
        c_kv, k_pe = (
            hf_cache.layers[layer].keys[0, 0],
            hf_cache.layers[layer].values[0, 0],
        )  # [T, R], [T, Dr]
        ours_pe = rows[:, r:]
        if (
            interleaved_v3
        ):  # transformers' V3 writes each rotated pair's first elements, then its second ones
            ours_pe = torch.cat([ours_pe[:, 0::2], ours_pe[:, 1::2]], dim=-1)
        # deeper layers' rows carry the f32 rounding of the layers before them
        torch.testing.assert_close(rows[:, :r], c_kv, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours_pe, k_pe, atol=1e-4, rtol=1e-4)
    while engine.llm.has_work():
        engine.llm.step()


def test_latent_rows_already_cached_are_attended_in_chunked_append_and_prefix_hit_prefills(
    tmp_path,
):
    """Chunked prefill (chunks of 4: every chunk an Append Prefill over cached latent rows),
    then a second request whose prompt extends the first's text: a prefix-cache hit served
    from the parked latent rows, its new tokens an Append Prefill."""
    model, path = _save(tmp_path, "v3-q_lora-yarn-mscale-dense")
    engine = zllm.Engine.from_config(
        write_config(
            tmp_path,
            path,
            runtime={
                "kv_cache": {"block_size": 4},
                "max_prefill_tokens": 4,
                "prefix_cache_seqs": 2,
            },
        )
    )
    first = _generate(engine)
    assert first["token_ids"] == _hf_greedy(model)
    extended = PROMPT + first["token_ids"][:9]
    second = _generate(engine, extended, 16)
    assert second["usage"]["cached_tokens"] >= 16  # whole blocks of the first sequence reused
    assert second["token_ids"] == _hf_greedy(model, extended, 16)


def test_kv_cache_holds_one_latent_row_per_token_and_layer(tmp_path):
    """MLA caches kv_lora_rank + qk_rope_head_dim values per token and layer; GQA with the
    same heads would cache K and V of every head: 2 * H * (Dn + Dr)."""
    model, path = _save(tmp_path, "v2-q_proj-dense")
    engine = zllm.Engine.from_config(write_config(tmp_path, path))
    spec = engine.llm.scheduler.kv.spec
    cfg = model.config
    mla_bytes = spec.token_bytes(4)
    assert (
        mla_bytes == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    )  # 320 B
    gqa_bytes = (
        cfg.num_hidden_layers
        * 2
        * cfg.num_attention_heads
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        * 4
    )
    assert gqa_bytes / mla_bytes == pytest.approx(4.8)  # 1536 B vs 320 B per token


def test_missing_kv_lora_rank_is_a_one_line_error_naming_the_key(tmp_path):
    _, path = _save(tmp_path, "v2-q_proj-dense")
    data = json.loads((path / "config.json").read_text())
    del data["kv_lora_rank"]
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ZllmError, match="deepseek_v2 config needs 'kv_lora_rank'") as e:
        zllm.Engine.from_config(write_config(tmp_path, path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"first_k_dense_replace": 1, "n_group": 2, "topk_group": 3}, r"topk_group 3 > n_group 2"),
        (
            {"first_k_dense_replace": 1, "num_experts_per_tok": 9},
            r"num_experts_per_tok 9 > n_routed_experts 8",
        ),
        (
            {"first_k_dense_replace": 1, "n_group": 3, "topk_group": 1},
            r"n_routed_experts 8 is not divisible into n_group 3",
        ),
        ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim 7 is not even"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(supported: silu\)"),
    ],
)
def test_contradicting_or_unsupported_settings_are_one_line_errors_naming_the_key(
    tmp_path, edit, message
):
    _, path = _save(tmp_path, "v3-yarn-mscale-1-dense")
    data = json.loads((path / "config.json").read_text())
    data.update(edit)
    (path / "config.json").write_text(json.dumps(data))
    started = []
    with pytest.raises(ZllmError, match=message) as e:
        zllm.Engine.from_config(write_config(tmp_path, path), on_start=started.append)
    assert "\n" not in str(e.value) and started == []


# ----------------------------------------------------------------------------- GGUF

STR, F32, U32, BOOL = (
    gguf.GGUFValueType.STRING,
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.BOOL,
)

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _write_gguf(model, path, dst, split_kv_b: bool, extra_kv=None):
    """An f32 ``deepseek2`` GGUF of a saved HF checkpoint as llama.cpp's converter lays it out
    (``DeepseekV2Model``): the MLA metadata (head_count_kv 1, key_length R + Dr, value_length R,
    the per-head dims in the ``*_mla`` keys), YaRN's log multiplier 0.1 * mscale_all_dim, the
    routing keys, experts stacked ``[E, N, K]``, and ``kv_b_proj`` whole or split per head into
    ``attn_k_b`` (transposed) + ``attn_v_b``; the stories260K vocabulary."""
    from safetensors.torch import load_file

    cfg = model.config
    sd = {k: v.float().numpy() for k, v in load_file(path / "model.safetensors").items()}
    w = gguf.GGUFWriter(dst, "deepseek2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.model_type == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    rope = cfg.rope_parameters
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    vocab = gguf.GGUFReader(next((MODEL_DIR / "gguf").glob("*f32.gguf")))
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(
                key,
                field.contents(),
                vtype,
                sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None,
            )
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, gg in _BLOCK.items():
            for kind in ("weight", "bias"):
                if (t := sd.get(f"{p}{hf}.{kind}")) is not None:
                    w.add_tensor(f"blk.{i}.{gg}.{kind}", np.ascontiguousarray(t))
        kv_b = sd[p + "self_attn.kv_b_proj.weight"]
        if split_kv_b:  # convert_hf_to_gguf.py DeepseekV2Model.modify_tensors
            kv_b = kv_b.reshape(h, dn + dv, -1)
            w.add_tensor(
                f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1))
            )
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, dn:]))
        else:
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b)
        if p + "mlp.gate.e_score_correction_bias" in sd:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
        for proj, gg in (
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ):
            experts = [
                sd.get(f"{p}mlp.experts.{e}.{proj}.weight") for e in range(cfg.n_routed_experts)
            ]
            if experts[0] is not None:
                w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(np.stack(experts)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    "case, split", [("v2-q_lora-yarn-dense", False), ("v3-yarn-mscale-1-dense", True)]
)
def test_gguf_written_from_hf_checkpoint_gives_the_same_tokens(tmp_path, case, split):
    """GGUF stores one YaRN multiplier (0.1 * mscale_all_dim) and llama.cpp takes mscale equal
    to it, so only checkpoints with mscale == mscale_all_dim (every released DeepSeek) convert."""
    model, path = _save(tmp_path, case)
    gguf_path = _write_gguf(model, path, tmp_path / f"{case}.gguf", split)
    (tmp_path / "g").mkdir()
    engine = zllm.Engine.from_config(write_config(tmp_path / "g", gguf_path))
    assert engine.loaded.family_info.name == "deepseek"
    assert engine.loaded.spec.kv_b_split is split
    _check_logits(engine.prompt_logits(PROMPT), _hf_logits(model, PROMPT))
    assert _generate(engine)["token_ids"] == _hf_greedy(model)


def test_gguf_softmax_router_with_groups_is_refused_naming_the_key(tmp_path):
    """llama.cpp scores groups by their top-2 sum, DeepSeek-V2 by their max: no faithful reading."""
    model, path = _save(tmp_path, "v2-q_proj-dense")
    dst = tmp_path / "grouped.gguf"
    _write_gguf(
        model, path, dst, split_kv_b=False, extra_kv={"deepseek2.expert_group_count": (4, U32)}
    )
    (tmp_path / "g").mkdir()
    with pytest.raises(
        ZllmError, match=r"deepseek2.expert_group_count > 1 with softmax gating"
    ) as e:
        zllm.Engine.from_config(write_config(tmp_path / "g", dst))
    assert "\n" not in str(e.value)
