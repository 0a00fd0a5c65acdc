"""MoE router and FFN references: properties over hypothesis-drawn routers (experts, top-k,
groups, batch sizes, tied scores) checked against a per-token loop, and every routing variant
against transformers 5's own MoE blocks built from tiny random configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2Moe,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3MoE,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeDecoderLayer,
    Qwen2MoeSparseMoeBlock,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from zllm.domain import moe as moe_ref
from zllm.domain.moe import (
    RouterConfig,
    SharedExperts,
    is_moe_layer,
    moe_ffn,
    route,
    router_config_from_hf,
    select_experts,
)
from zllm.domain.quant import dequantize
from zllm.weights.formats import QuantizedTensor

# ------------------------------------------------------------------ properties vs a per-token loop


@st.composite
def routers(draw):
    """A valid RouterConfig of any variant, its logits (often tied) and the correction bias."""
    method = draw(st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]))
    n_group = 1 if method == "greedy" else draw(st.integers(1, 4))
    per_group = draw(st.integers(2 if method == "noaux_tc" else 1, 5))
    n_experts = n_group * per_group
    topk_group = draw(st.integers(1, n_group))
    kept = n_experts if method == "greedy" else topk_group * per_group
    cfg = RouterConfig(
        num_experts=n_experts,
        num_experts_per_tok=draw(st.integers(1, kept)),
        scoring_func="sigmoid"
        if method == "noaux_tc"
        else draw(st.sampled_from(["softmax", "sigmoid"])),
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 16.0])),
    )
    t = draw(st.integers(1, 9))  # up to 4 rows the tie check is a Python loop, above a tensor op
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if draw(st.booleans()):  # few distinct values: ties between experts and between groups
        logits = torch.randint(-1, 2, (t, n_experts), generator=g).float()
    else:
        # x60: scores down to ~1e-50 (sigmoid) and softmax rows dominated by one expert
        logits = torch.randn(t, n_experts, generator=g) * draw(st.sampled_from([3.0, 60.0]))
    bias = None
    if method == "noaux_tc":
        bias = (
            torch.randint(-1, 2, (n_experts,), generator=g).float() * 0.25
            if draw(st.booleans())
            else torch.randn(n_experts, generator=g) * 0.1
        )
    return cfg, logits, bias


def naive_selection(
    cfg: RouterConfig, logits: torch.Tensor, bias: torch.Tensor | None
) -> list[list[int]]:
    """Per token: rank groups, then experts, by (score descending, index ascending) in Python."""
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    per_group = cfg.num_experts // cfg.n_group
    picked = []
    for row in choice.tolist():
        allowed: list[int] = list(range(cfg.num_experts))
        if cfg.topk_method != "greedy":
            tops = [
                sorted(row[g * per_group : (g + 1) * per_group], reverse=True)
                for g in range(cfg.n_group)
            ]
            by_max = cfg.topk_method == "group_limited_greedy"
            # A top-2 sum in f32, as the router adds them: exact ties must stay ties.
            group_scores = [top[0] if by_max else float(torch.tensor(top[0], dtype=torch.float32) + top[1])
                            for top in tops]
            groups = [g for _, g in sorted((-score, g) for g, score in enumerate(group_scores))]
            allowed = [
                e
                for g in groups[: cfg.topk_group]
                for e in range(g * per_group, (g + 1) * per_group)
            ]
        picked.append(
            [e for _, e in sorted((-row[e], e) for e in allowed)][: cfg.num_experts_per_tok]
        )
    return picked


@settings(max_examples=150, deadline=None)
@given(routers())
def test_router_picks_the_top_k_of_the_kept_groups_lowest_index_first_on_ties(router):
    cfg, logits, bias = router
    out = select_experts(logits, cfg, bias)
    t, k = logits.shape[0], cfg.num_experts_per_tok
    assert out.topk_ids.shape == out.topk_weights.shape == (t, k)
    assert out.topk_ids.dtype == torch.int64 and out.topk_weights.dtype == torch.float32
    assert out.topk_ids.tolist() == naive_selection(cfg, logits, bias)
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    expected = scores.gather(1, out.topk_ids)  # unbiased scores of the chosen experts
    if cfg.norm_topk_prob:  # the epsilon matters only for sums of tiny sigmoid scores
        expected = expected / (expected.sum(-1, keepdim=True) + moe_ref._RENORM_EPS)
    torch.testing.assert_close(
        out.topk_weights, expected * cfg.routed_scaling_factor, rtol=1e-6, atol=1e-7
    )


def sorted_selection(cfg: RouterConfig, logits: torch.Tensor, bias: torch.Tensor | None):
    """The router as its formulas read, one tensor op per step: a stable descending sort of the
    (biased, group-masked) scores, the unbiased scores gathered, ``/ (sum + eps)``, ``* factor``."""
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.topk_method != "greedy":
        choice = moe_ref._mask_groups(choice, cfg)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : cfg.num_experts_per_tok]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + moe_ref._RENORM_EPS)
    return ids, weights * cfg.routed_scaling_factor


@settings(max_examples=150, deadline=None)
@given(routers())
def test_router_gives_the_bits_of_the_sorted_formula(router):
    """The decode path (top-k + a tie check, the epsilon and a factor of 1 skipped where they
    round away) changes no bit of the ids or weights."""
    cfg, logits, bias = router
    out = select_experts(logits, cfg, bias)
    ids, weights = sorted_selection(cfg, logits, bias)
    assert torch.equal(out.topk_ids, ids)
    assert torch.equal(out.topk_weights, weights)


def test_router_refuses_non_finite_logits_even_where_the_sum_overflows():
    cfg = RouterConfig(4, 2)
    huge = torch.full((1, 4), 3e38)  # finite, but the sum overflows
    assert select_experts(huge, cfg).topk_ids.tolist() == [[0, 1]]
    for bad in (float("inf"), float("-inf"), float("nan")):
        logits = torch.zeros(1, 4)
        logits[0, 2] = bad
        with pytest.raises(AssertionError, match="not finite"):
            select_experts(logits, cfg)


def per_token_moe(x, ids, weights, gate, up, down):
    """sum_j w_j * down_e(silu(gate_e x) * up_e x) for each token, one expert at a time, and the
    same sum of the terms' magnitudes (what f32 rounding of the sum is relative to)."""
    out, magnitude = torch.zeros_like(x), torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += weights[t, j] * (down[e] @ h)
            magnitude[t] += (weights[t, j] * (down[e].abs() @ h.abs())).abs()
    return out, magnitude


def assert_close_to_terms(got, expected, magnitude):
    """``got`` within f32 rounding of ``expected``: 1e-5 of the summed magnitude of the terms
    (a large ``routed_scaling_factor`` makes terms that cancel), plus 1e-5."""
    excess = (got - expected).abs() - (1e-5 * magnitude + 1e-5)
    assert excess.max() <= 0, (got, expected, magnitude)


@settings(max_examples=60, deadline=None)
@given(routers(), st.integers(1, 12), st.integers(1, 9), st.integers(0, 2**16), st.booleans())
def test_moe_output_is_the_sum_over_selected_experts_one_by_one(
    router, hidden, inter, seed, shared_gate
):
    cfg, logits, bias = router
    g = torch.Generator().manual_seed(seed)
    e, t = cfg.num_experts, logits.shape[0]
    x = torch.randn(t, hidden, generator=g)
    gate_w = torch.randn(e, hidden, generator=g)
    gate, up = (
        torch.randn(e, inter, hidden, generator=g),
        torch.randn(e, inter, hidden, generator=g),
    )
    down = torch.randn(e, hidden, inter, generator=g)
    shared = SharedExperts(
        torch.randn(inter, hidden, generator=g),
        torch.randn(inter, hidden, generator=g),
        torch.randn(hidden, inter, generator=g),
        torch.randn(1, hidden, generator=g) if shared_gate else None,
    )
    routing = route(x, gate_w, cfg, bias)
    expected, magnitude = per_token_moe(x, routing.topk_ids, routing.topk_weights, gate, up, down)
    assert_close_to_terms(moe_ffn(x, routing, gate, up, down), expected, magnitude)
    h = torch.nn.functional.silu(shared.gate_proj @ x.T) * (shared.up_proj @ x.T)  # [N, T]
    s, s_magnitude = shared.down_proj @ h, shared.down_proj.abs() @ h.abs()  # [K, T] each
    if shared_gate:
        s = s * torch.sigmoid(shared.shared_expert_gate @ x.T)
    assert_close_to_terms(moe_ffn(x, routing, gate, up, down, shared), expected + s.T, magnitude + s_magnitude.T)


def test_moe_reads_experts_through_their_slices_only():
    """A stacked weight is read as ``w[e]`` for the selected experts only, as quantized ones are."""

    class Recording:
        def __init__(self, w: torch.Tensor) -> None:
            self.w, self.shape, self.read = w, tuple(w.shape), set[int]()

        def __getitem__(self, e: int) -> torch.Tensor:
            self.read.add(e)
            return self.w[e]

    g = torch.Generator().manual_seed(3)
    cfg = RouterConfig(num_experts=8, num_experts_per_tok=2)
    x = torch.randn(3, 4, generator=g)
    stacks = [
        torch.randn(8, 5, 4, generator=g),
        torch.randn(8, 5, 4, generator=g),
        torch.randn(8, 4, 5, generator=g),
    ]
    routing = route(x, torch.randn(8, 4, generator=g), cfg)
    wrapped = [Recording(w) for w in stacks]
    torch.testing.assert_close(moe_ffn(x, routing, *wrapped), moe_ffn(x, routing, *stacks))
    assert all(w.read == set(routing.topk_ids.flatten().tolist()) for w in wrapped)


def test_moe_takes_quantized_experts_one_slice_each():
    """Q8_0 experts handed out per slice give the MoE of their dequantized dense stack."""

    class Q8Stack:
        def __init__(self, experts: list[QuantizedTensor]) -> None:
            self.experts, self.shape = experts, (len(experts), *experts[0].shape)

        def __getitem__(self, e: int) -> QuantizedTensor:
            return self.experts[e]

    g = torch.Generator().manual_seed(5)

    def q8_0(rows: int, cols: int) -> QuantizedTensor:  # ggml block: f16 scale, 32 int8
        raw = torch.randint(0, 256, (rows, cols // 32, 34), dtype=torch.uint8, generator=g)
        raw[..., :2] = (
            (torch.rand(rows, cols // 32, 1, generator=g) * 0.01).half().view(torch.uint8)
        )
        return QuantizedTensor(raw.view(rows, -1), "q8_0", (rows, cols))

    n_experts, hidden, inter = 4, 64, 32
    stacks = [
        Q8Stack([q8_0(inter, hidden) for _ in range(n_experts)]),
        Q8Stack([q8_0(inter, hidden) for _ in range(n_experts)]),
        Q8Stack([q8_0(hidden, inter) for _ in range(n_experts)]),
    ]
    dense = [torch.stack([dequantize(q) for q in s.experts]) for s in stacks]
    x = torch.randn(5, hidden, generator=g)
    routing = route(
        x,
        torch.randn(n_experts, hidden, generator=g),
        RouterConfig(n_experts, 2, norm_topk_prob=True),
    )
    torch.testing.assert_close(
        moe_ffn(x, routing, *stacks), moe_ffn(x, routing, *dense), rtol=1e-6, atol=1e-6
    )


def test_correction_bias_steers_the_choice_but_not_the_weights():
    cfg = RouterConfig(
        num_experts=4,
        num_experts_per_tok=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=2.0,
    )
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])  # group 1 sums 0.5 + 2.27 > group 0's 0.88 + 0.73
    out = select_experts(logits, cfg, bias)
    assert out.topk_ids.tolist() == [[3]]
    torch.testing.assert_close(out.topk_weights, torch.sigmoid(torch.tensor([[-1.0]])) * 2.0)


# ------------------------------------------------------------------ transformers' own blocks

TINY = dict(
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=32,
)


def _hf_cases():
    return {
        "mixtral": (
            transformers.MixtralConfig(**TINY, num_local_experts=6, num_experts_per_tok=2),
            MixtralSparseMoeBlock,
        ),
        "qwen2_moe-norm": (
            transformers.Qwen2MoeConfig(
                **TINY,
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=12,
                norm_topk_prob=True,
            ),
            Qwen2MoeSparseMoeBlock,
        ),
        "qwen2_moe": (
            transformers.Qwen2MoeConfig(
                **TINY,
                num_experts=6,
                num_experts_per_tok=3,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=12,
                norm_topk_prob=False,
            ),
            Qwen2MoeSparseMoeBlock,
        ),
        "qwen3_moe-norm": (
            transformers.Qwen3MoeConfig(
                **TINY,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                norm_topk_prob=True,
            ),
            Qwen3MoeSparseMoeBlock,
        ),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig(
                **TINY,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                norm_topk_prob=False,
            ),
            Qwen3MoeSparseMoeBlock,
        ),
        "deepseek_v2-greedy": (
            transformers.DeepseekV2Config(
                **TINY,
                n_routed_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=8,
                n_shared_experts=2,
                routed_scaling_factor=1.5,
                topk_method="greedy",
            ),
            DeepseekV2Moe,
        ),
        "deepseek_v2-grouped": (
            transformers.DeepseekV2Config(
                **TINY,
                n_routed_experts=12,
                num_experts_per_tok=3,
                moe_intermediate_size=8,
                n_shared_experts=1,
                n_group=3,
                topk_group=1,
                routed_scaling_factor=16.0,
                topk_method="group_limited_greedy",
            ),
            DeepseekV2Moe,
        ),
        "deepseek_v3-norm": (
            transformers.DeepseekV3Config(
                **TINY,
                n_routed_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=8,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            ),
            DeepseekV3MoE,
        ),
        "deepseek_v3": (
            transformers.DeepseekV3Config(
                **TINY,
                n_routed_experts=12,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                n_shared_experts=2,
                n_group=3,
                topk_group=1,
                routed_scaling_factor=1.0,
                norm_topk_prob=False,
            ),
            DeepseekV3MoE,
        ),
    }


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _ours(block: Any, hf_config, x: torch.Tensor):
    """zllm's routing and MoE output from the block's weights and the config transformers writes."""
    cfg = router_config_from_hf(hf_config.to_dict())
    bias = getattr(block.gate, "e_score_correction_bias", None)
    routing = route(x, block.gate.weight.detach(), cfg, None if bias is None else bias.detach())
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    n = gate_up.shape[1] // 2
    shared = None
    if hasattr(block, "shared_experts") or hasattr(block, "shared_expert"):
        mlp = block.shared_experts if hasattr(block, "shared_experts") else block.shared_expert
        gate_w = (
            block.shared_expert_gate.weight.detach()
            if hasattr(block, "shared_expert_gate")
            else None
        )
        shared = SharedExperts(
            mlp.gate_proj.weight.detach(),
            mlp.up_proj.weight.detach(),
            mlp.down_proj.weight.detach(),
            gate_w,
        )
    return routing, moe_ffn(x, routing, gate_up[:, :n], gate_up[:, n:], down, shared)


@pytest.mark.parametrize("case", sorted(_hf_cases()))
def test_routing_and_output_equal_transformers_moe_block(case):
    hf_config, block_cls = _hf_cases()[case]
    block = block_cls(hf_config).eval()
    _randomize(block, seed=len(case))
    x = torch.randn(16, hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        hf_out = block(x[None])[0]
    routing, out = _ours(block, hf_config, x)
    # transformers' top-k is unsorted for DeepSeek: compare as sets, ordered by expert id
    order, hf_order = routing.topk_ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(routing.topk_ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(
        routing.topk_weights.gather(1, order),
        hf_weights.float().gather(1, hf_order),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model_type, extra, layer_cls, sparse",
    [
        (
            "qwen2_moe",
            dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3]),
            Qwen2MoeDecoderLayer,
            [False, True, False, False, False, True],
        ),
        (
            "deepseek_v2",
            dict(
                n_routed_experts=4,
                num_experts_per_tok=2,
                first_k_dense_replace=2,
                q_lora_rank=None,
                kv_lora_rank=8,
                qk_nope_head_dim=4,
                qk_rope_head_dim=4,
                v_head_dim=4,
            ),
            DeepseekV2DecoderLayer,
            [False, False, True, True, True, True],
        ),
        (
            "deepseek_v3",
            dict(
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=None,
                kv_lora_rank=8,
                qk_nope_head_dim=4,
                qk_rope_head_dim=4,
                v_head_dim=4,
            ),
            DeepseekV3DecoderLayer,
            [False, True, True, True, True, True],
        ),
    ],
)
def test_dense_and_moe_layers_are_where_transformers_puts_them(
    model_type, extra, layer_cls, sparse
):
    hf_config = transformers.AutoConfig.for_model(model_type, **TINY, num_hidden_layers=6, **extra)
    cfg = hf_config.to_dict()
    hf_sparse = [hasattr(layer_cls(hf_config, i).mlp, "experts") for i in range(6)]
    assert hf_sparse == sparse
    assert [is_moe_layer(cfg, i) for i in range(6)] == sparse
    assert all(is_moe_layer({"model_type": "mixtral"}, i) for i in range(6))


# ------------------------------------------------------------------ bad settings name the key


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {
                "model_type": "deepseek_v3",
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 3,
            },
            "topk_group 3 > n_group 2",
        ),
        (
            {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
            "num_experts_per_tok 5 > num_local_experts 4",
        ),
        (
            {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5},
            "num_experts_per_tok 5 > num_experts 4",
        ),
        (
            {
                "model_type": "deepseek_v2",
                "n_routed_experts": 10,
                "num_experts_per_tok": 2,
                "topk_method": "group_limited_greedy",
                "n_group": 4,
                "topk_group": 2,
            },
            "n_routed_experts 10 is not divisible into n_group 4 groups",
        ),
        (
            {
                "model_type": "deepseek_v3",
                "n_routed_experts": 8,
                "num_experts_per_tok": 5,
                "n_group": 4,
                "topk_group": 2,
            },
            "num_experts_per_tok 5 > the 4 experts that topk_group 2 groups of 2 hold",
        ),
        (
            {
                "model_type": "deepseek_v3",
                "n_routed_experts": 4,
                "num_experts_per_tok": 1,
                "n_group": 4,
                "topk_group": 1,
            },
            "scores a group by its top-2 experts",
        ),
        (
            {
                "model_type": "deepseek_v2",
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "topk_method": "group_limited_greedy",
                "topk_group": 2,
            },
            "deepseek_v2 config needs 'n_group'",
        ),
        (
            {
                "model_type": "deepseek_v2",
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "topk_method": "noaux_tc",
            },
            "topk_method 'noaux_tc' is not supported for deepseek_v2",
        ),
        (
            {"model_type": "deepseek_v3", "n_routed_experts": 8, "scoring_func": "softmax"},
            "scoring_func 'softmax' is not supported for deepseek_v3",
        ),
        (
            {
                "model_type": "qwen2_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "norm_topk_prob": "yes",
            },
            "norm_topk_prob 'yes' is not true or false",
        ),
        ({"model_type": "llama"}, "model_type 'llama' has no MoE router"),
        (
            {
                "model_type": "deepseek_v2",
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 4,
            },
            "topk_group 4 > n_group 2",
        ),
    ],
)
def test_contradictory_router_settings_raise_naming_the_key(cfg, message):
    with pytest.raises(ValueError, match=message):
        router_config_from_hf(cfg)


def test_qwen3_moe_expert_count_is_read_under_either_key():
    saved = transformers.Qwen3MoeConfig(
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True
    ).to_dict()
    assert "num_local_experts" in saved  # transformers 5 writes the attribute-map name
    released = {
        "model_type": "qwen3_moe",
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    }
    assert (
        router_config_from_hf(saved)
        == router_config_from_hf(released)
        == RouterConfig(6, 2, norm_topk_prob=True)
    )
