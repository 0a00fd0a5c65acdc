"""MLA references vs transformers 5's ``DeepseekV2Attention`` / ``DeepseekV3Attention`` (q_lora_rank
null and set, YaRN with mscale, both rope layouts, attention bias), the cached latent rows vs
transformers' cache, and the expanded form vs the absorbed one over paged latent caches."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.mla import (
    MlaConfig,
    MlaWeights,
    mla_absorbed_attention,
    mla_attention,
    mla_config_from_hf,
    mla_expanded_attention,
    mla_paged_attention,
    mla_project,
)
from zllm.domain.rope import RopeParams, deepseek_softmax_scale, rope_cos_sin, rope_inv_freq

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-q_proj": ("deepseek_v2", dict(q_lora_rank=None)),
    "v2-q_lora-yarn": (
        "deepseek_v2",
        dict(q_lora_rank=12, rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    ),
    "v3-q_lora-yarn": (
        "deepseek_v3",
        dict(q_lora_rank=12, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
    ),
    "v3-halves-bias": (
        "deepseek_v3",
        dict(
            q_lora_rank=None,
            rope_interleave=False,
            attention_bias=True,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    ),
}
ATTENTION = {
    "deepseek_v2": (DeepseekV2Attention, DeepseekV2RotaryEmbedding),
    "deepseek_v3": (DeepseekV3Attention, DeepseekV3RotaryEmbedding),
}


def hf_layer(case: str):
    model_type, extra = CASES[case]
    hf_config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=24,
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        max_position_embeddings=64,
        attn_implementation="eager",
        **extra,
    )
    attn_cls, rotary_cls = ATTENTION[model_type]
    attn = attn_cls(hf_config, 0).eval()
    g = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        for p in attn.parameters():  # norms too, so that their weights are exercised
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return hf_config, attn, rotary_cls(hf_config)


def hf_forward(model_type: str, attn, rotary, x: torch.Tensor, cache=None) -> torch.Tensor:
    t = x.shape[0]
    pe = rotary(x[None], torch.arange(t)[None])
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        if model_type == "deepseek_v2":
            out, _ = attn(
                hidden_states=x[None], attention_mask=mask, position_embeddings=pe, cache=cache
            )
        else:
            out, _ = attn(
                hidden_states=x[None], position_embeddings=pe, attention_mask=mask, cache=cache
            )
    return out[0]


def zllm_weights(attn) -> MlaWeights:
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    return MlaWeights(
        kv_a_proj_with_mqa=sd["kv_a_proj_with_mqa.weight"],
        kv_a_layernorm=sd["kv_a_layernorm.weight"],
        kv_b_proj=sd["kv_b_proj.weight"],
        o_proj=sd["o_proj.weight"],
        q_proj=sd.get("q_proj.weight"),
        q_a_proj=sd.get("q_a_proj.weight"),
        q_a_layernorm=sd.get("q_a_layernorm.weight"),
        q_b_proj=sd.get("q_b_proj.weight"),
        q_a_proj_bias=sd.get("q_a_proj.bias"),
        kv_a_proj_with_mqa_bias=sd.get("kv_a_proj_with_mqa.bias"),
        o_proj_bias=sd.get("o_proj.bias"),
    )


def rope_tables(cfg: MlaConfig, rope: RopeParams, positions: torch.Tensor):
    inv_freq, factor = rope_inv_freq(cfg.qk_rope_head_dim, rope)
    return rope_cos_sin(positions, inv_freq, factor)


def one_sequence_meta(
    positions: range, block_table: torch.Tensor, bs: int, context_len: int, scale: float
):
    pos = torch.tensor(list(positions))
    slots = block_table[pos // bs] * bs + pos % bs
    return AttentionMetadata(slots, block_table[None], (len(positions),), (context_len,), scale)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_layer_equals_transformers_attention_in_prefill_append_and_decode(case):
    model_type = CASES[case][0]
    hf_config, attn, rotary = hf_layer(case)
    cfg, rope = mla_config_from_hf(hf_config.to_dict())
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert (cfg.q_lora_rank is None) == (attn.q_lora_rank is None)
    t = 13
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = hf_forward(model_type, attn, rotary, x)  # [T, K]; row p depends on tokens <= p only
    w = zllm_weights(attn)
    cos, sin = rope_tables(cfg, rope, torch.arange(t))
    bs = 4
    table = torch.tensor([5, 2, 7, 0, -1])  # blocks out of order, padding at the end
    for form in ("expanded", "absorbed"):
        # one New Prefill of all tokens
        cache = torch.randn(8, bs, cfg.latent_dim)
        out = mla_attention(
            x,
            w,
            cfg,
            cos,
            sin,
            cache,
            one_sequence_meta(range(t), table, bs, t, cfg.softmax_scale),
            form,
        )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        # prefill 6, Append Prefill 4, then three decode steps, over the same cache
        cache = torch.randn(8, bs, cfg.latent_dim)
        rows = []
        for start, stop in [(0, 6), (6, 10), (10, 11), (11, 12), (12, 13)]:
            meta = one_sequence_meta(range(start, stop), table, bs, stop, cfg.softmax_scale)
            rows.append(
                mla_attention(
                    x[start:stop], w, cfg, cos[start:stop], sin[start:stop], cache, meta, form
                )
            )
        torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_latent_rows_equal_transformers_cache(case):
    model_type = CASES[case][0]
    hf_config, attn, rotary = hf_layer(case)
    cfg, rope = mla_config_from_hf(hf_config.to_dict())
    t = 7
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    hf_cache = DynamicCache(config=hf_config)
    hf_forward(model_type, attn, rotary, x, hf_cache)
    c_kv, k_pe = hf_cache.layers[0].keys[0, 0], hf_cache.layers[0].values[0, 0]  # [T, R], [T, Dr]
    latent = mla_project(
        x, zllm_weights(attn), cfg, *rope_tables(cfg, rope, torch.arange(t))
    ).latent
    ours_c_kv, ours_k_pe = latent[:, : cfg.kv_lora_rank], latent[:, cfg.kv_lora_rank :]
    if model_type == "deepseek_v3" and cfg.rope_interleave:
        # transformers' V3 writes each rotated pair's first elements, then its second ones
        ours_k_pe = torch.cat([ours_k_pe[:, 0::2], ours_k_pe[:, 1::2]], dim=-1)
    torch.testing.assert_close(ours_c_kv, c_kv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_k_pe, k_pe, rtol=1e-5, atol=1e-6)


def test_deepseek_yarn_softmax_scale_multiplies_by_mscale_squared():
    rope = RopeParams(rope_type="yarn", factor=40.0, mscale=0.707, mscale_all_dim=0.707)
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert deepseek_softmax_scale(192, rope) == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert deepseek_softmax_scale(192, RopeParams()) == 192**-0.5
    assert (
        deepseek_softmax_scale(192, RopeParams(rope_type="yarn", factor=40.0)) == 192**-0.5
    )  # no mscale_all_dim


# ------------------------------------------------------------------ expanded == absorbed, paged


@st.composite
def paged_mla_batch(draw):
    h = draw(st.integers(1, 4))
    nope, rope, v, rank = (
        draw(st.integers(1, 8)),
        draw(st.sampled_from([2, 4, 8])),
        draw(st.integers(1, 8)),
        draw(st.integers(1, 12)),
    )
    bs = draw(st.sampled_from([1, 2, 3, 4, 16]))
    lens = []
    for _ in range(draw(st.integers(1, 3))):
        n_ctx = draw(st.integers(1, 21))
        kind = draw(st.sampled_from(["new", "append", "decode"]))
        lens.append(
            ({"new": n_ctx, "decode": 1, "append": draw(st.integers(1, n_ctx))}[kind], n_ctx)
        )
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return h, nope, rope, v, rank, bs, lens, dtype, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(paged_mla_batch())
def test_absorbed_form_equals_expanded_form_over_paged_latent_cache(batch):
    h, nope, rope, v, rank, bs, lens, dtype, seed = batch
    g = torch.Generator().manual_seed(seed)
    width = rank + rope
    n_blocks = sum(-(-n_ctx // bs) for _, n_ctx in lens) + 2
    cache = torch.randn(n_blocks, bs, width, generator=g).to(dtype)  # garbage outside the sequences
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.full((len(lens), n_blocks), -1, dtype=torch.int64)
    used, slots, new_rows, histories = 0, [], [], []
    for s, (n_q, n_ctx) in enumerate(lens):
        n_b = -(-n_ctx // bs)
        tables[s, :n_b] = perm[used : used + n_b]
        used += n_b
        pos = torch.arange(n_ctx)
        slot = tables[s][pos // bs] * bs + pos % bs
        history = (
            torch.randn(n_ctx, width, generator=g).to(dtype).float()
        )  # representable in the cache type
        cache.view(-1, width)[slot[: n_ctx - n_q]] = history[: n_ctx - n_q].to(dtype)
        (
            slots.append(slot[n_ctx - n_q :]),
            new_rows.append(history[n_ctx - n_q :]),
            histories.append(history),
        )
    t = sum(q for q, _ in lens)
    q_nope, q_pe = torch.randn(t, h, nope, generator=g), torch.randn(t, h, rope, generator=g)
    kv_b = torch.randn(h * (nope + v), rank, generator=g) / math.sqrt(rank)
    scale = (nope + rope) ** -0.5
    meta = AttentionMetadata(
        torch.cat(slots), tables, tuple(q for q, _ in lens), tuple(c for _, c in lens), scale
    )
    outs = {
        form: mla_paged_attention(
            q_nope, q_pe, torch.cat(new_rows), cache.clone(), kv_b, meta, form
        )
        for form in ("expanded", "absorbed")
    }
    assert outs["expanded"].shape == (t, h, v) and outs["expanded"].dtype == torch.float32
    torch.testing.assert_close(outs["absorbed"], outs["expanded"], rtol=1e-5, atol=1e-5)
    start = 0
    for (n_q, _), history in zip(
        lens, histories, strict=True
    ):  # each sequence alone, its rows contiguous
        q_slice = slice(start, start + n_q)
        alone = mla_absorbed_attention(q_nope[q_slice], q_pe[q_slice], history, kv_b, scale)
        torch.testing.assert_close(outs["absorbed"][q_slice], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            mla_expanded_attention(q_nope[q_slice], q_pe[q_slice], history, kv_b, scale),
            alone,
            rtol=1e-5,
            atol=1e-5,
        )
        start += n_q


# ------------------------------------------------------------------ bad settings name the key


@pytest.mark.parametrize(
    "drop, change, message",
    [
        ("kv_lora_rank", {}, "deepseek_v2 config needs 'kv_lora_rank'"),
        (None, {"qk_rope_head_dim": 5}, "qk_rope_head_dim 5 is not even"),
        (None, {"q_lora_rank": 0}, "q_lora_rank 0 is not null or an integer >= 1"),
        (None, {"model_type": "llama"}, "model_type 'llama' has no MLA attention"),
        (
            None,
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}},
            "mscale_all_dim with RoPE type 'linear' is not supported",
        ),
    ],
)
def test_bad_mla_settings_raise_naming_the_key(drop, change, message):
    cfg = transformers.DeepseekV2Config(
        hidden_size=24, num_attention_heads=3, kv_lora_rank=10, q_lora_rank=None
    ).to_dict()
    if drop:
        del cfg[drop]
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        mla_config_from_hf(cfg)
