"""gpt-oss's MoE references against transformers 5's own modules (``GptOssTopKRouter``,
``GptOssExperts`` and its ``_apply_gate``) built from tiny random configs, plus the tie rule
and a per-token loop over hypothesis-drawn shapes."""

from __future__ import annotations

import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from zllm.domain.activation import swiglu_clamped
from zllm.domain.linear import linear
from zllm.domain.moe_biased import moe_clamped_swiglu, router_topk_softmax


def _config(**kw):
    return transformers.AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=8,
                                             num_experts_per_tok=3, **kw)


def _stacks(experts: GptOssExperts):
    """transformers' ``x @ W`` parameters as the op's ``[E, N, K]`` / ``[E, K, N]`` stacks and biases."""
    gate_up, bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    return (gate_up[:, :, 0::2].transpose(1, 2), gate_up[:, :, 1::2].transpose(1, 2),
            experts.down_proj.detach().transpose(1, 2), bias[:, 0::2], bias[:, 1::2],
            experts.down_proj_bias.detach())


def test_router_equals_transformers_top_k_then_softmax():
    torch.manual_seed(0)
    router = GptOssTopKRouter(_config())
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.bias.normal_(0, 1.0)
    x = torch.randn(11, 64)
    _, hf_weights, hf_ids = router(x)
    ids, weights = router_topk_softmax(linear(x, router.weight.detach(), router.bias.detach()), 3)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)


def test_router_ties_go_to_the_lowest_expert_in_descending_order():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    ids, weights = router_topk_softmax(logits, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    torch.testing.assert_close(weights[1], torch.full((3,), 1 / 3))


def test_clamped_swiglu_equals_transformers_apply_gate():
    experts = GptOssExperts(_config(swiglu_limit=2.5, swiglu_alpha=1.3))
    gate_up = torch.randn(9, 64) * 4  # well past the limit on both sides
    expected = experts._apply_gate(gate_up)
    torch.testing.assert_close(swiglu_clamped(gate_up[:, 0::2], gate_up[:, 1::2], 1.3, 2.5), expected, atol=0, rtol=0)
    # the clamp matters here: without it the values differ
    assert not torch.allclose(swiglu_clamped(gate_up[:, 0::2], gate_up[:, 1::2], 1.3, 1e9), expected)


def test_expert_ffn_equals_transformers_gpt_oss_experts():
    torch.manual_seed(1)
    experts = GptOssExperts(_config())
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(13, 64)
    ids, weights = router_topk_softmax(torch.randn(13, 8), 3)
    expected = experts(x, ids, weights)
    ours = moe_clamped_swiglu(x, ids, weights, *_stacks(experts), 1.702, 7.0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(t=st.integers(0, 9), e=st.integers(1, 6), data=st.data())
def test_expert_ffn_is_each_tokens_weighted_sum_of_its_experts(t, e, data):
    k = data.draw(st.integers(1, e))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(t, 8, generator=g)
    gate, up, down = torch.randn(e, 4, 8, generator=g), torch.randn(e, 4, 8, generator=g), torch.randn(e, 8, 4,
                                                                                                        generator=g)
    gb, ub, db = torch.randn(e, 4, generator=g), torch.randn(e, 4, generator=g), torch.randn(e, 8, generator=g)
    ids, weights = router_topk_softmax(torch.randn(t, e, generator=g), k)
    out = moe_clamped_swiglu(x, ids, weights, gate, up, down, gb, ub, db, 1.702, 1.5)
    for i in range(t):
        want = torch.zeros(8)
        for j in range(k):
            ex = int(ids[i, j])
            h = swiglu_clamped((x[i] @ gate[ex].T + gb[ex])[None], (x[i] @ up[ex].T + ub[ex])[None], 1.702, 1.5)[0]
            want += weights[i, j] * (h @ down[ex].T + db[ex])
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(weights.sum(-1), torch.ones(t))
