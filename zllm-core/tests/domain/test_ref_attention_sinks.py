"""The attention-sinks reference against transformers 5's ``gpt_oss`` eager attention (the sink
column appended to the scores, the row max over all columns, the column dropped), full and
sliding; a sink of -inf-like size is plain attention; the paged form equals the dense one
over a block table in random order, in one prefill or token by token."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.attention import causal_softmax_attention
from zllm.domain.attention_sinks import attention_sinks, sink_softmax_attention

H, HKV, D = 4, 2, 8


def _hf(q, k, v, sinks, scale, window):
    """transformers' eager gpt-oss attention over one sequence whose queries are its last keys."""
    n_q, n_k = q.shape[0], k.shape[0]
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    k_pos = torch.arange(n_k)[None, :]
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    mask = torch.zeros(n_q, n_k).masked_fill(~allowed, float("-inf"))[None, None]  # [1, 1, Q, L]
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=H // HKV, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=scale)
    return out[0]  # [Q, H, D]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n_q", [1, 7, 12])
def test_sink_softmax_equals_transformers_gpt_oss_eager_attention(window, n_q):
    g = torch.Generator().manual_seed(n_q)
    q, k, v = torch.randn(n_q, H, D, generator=g), torch.randn(12, HKV, D, generator=g), torch.randn(12, HKV, D,
                                                                                                    generator=g)
    sinks = torch.randn(H, generator=g) * 3
    ours = sink_softmax_attention(q, k, v, sinks, D ** -0.5, window)
    torch.testing.assert_close(ours, _hf(q, k, v, sinks, D ** -0.5, window), atol=1e-6, rtol=1e-5)


def test_a_very_negative_sink_is_plain_attention_and_a_large_one_silences_the_head():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, H, D, generator=g)
    k, v = torch.randn(9, HKV, D, generator=g), torch.randn(9, HKV, D, generator=g)
    plain = causal_softmax_attention(q, k, v, 0.3)
    torch.testing.assert_close(sink_softmax_attention(q, k, v, torch.full((H,), -1e4), 0.3), plain)
    loud = sink_softmax_attention(q, k, v, torch.tensor([1e4, -1e4, -1e4, -1e4]), 0.3)
    assert loud[:, 0].abs().max() == 0 and torch.allclose(loud[:, 1:], plain[:, 1:])


@pytest.mark.parametrize("window", [None, 6])
def test_paged_prefill_and_token_by_token_decode_equal_the_dense_form(window):
    g = torch.Generator().manual_seed(7)
    n, bs = 19, 4
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    sinks = torch.randn(H, generator=g)
    blocks = torch.randperm(8, generator=g)[: -(-n // bs)]  # this sequence's blocks, in random order
    table = torch.cat([blocks, torch.tensor([-1])])[None]  # [1, MB]
    slots = torch.tensor([int(blocks[p // bs]) * bs + p % bs for p in range(n)])
    dense = sink_softmax_attention(q, k, v, sinks, 0.35, window)
    caches = torch.randn(2, 8, bs, HKV, D, generator=g)  # stale values where nothing was written
    prefill = attention_sinks(q, k, v, caches[0].clone(), caches[1].clone(), AttentionMetadata(
        slots, table, (n,), (n,), 0.35), sinks, window)
    torch.testing.assert_close(prefill, dense, atol=1e-6, rtol=1e-5)
    kc, vc = caches[0].clone(), caches[1].clone()
    for p in range(n):
        row = attention_sinks(q[p:p + 1], k[p:p + 1], v[p:p + 1], kc, vc,
                              AttentionMetadata(slots[p:p + 1], table, (1,), (p + 1,), 0.35), sinks, window)
        torch.testing.assert_close(row[0], dense[p], atol=1e-6, rtol=1e-5)
