"""RMSNorm and RoPE references vs HF transformers' Llama implementation."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from zllm.domain.norm import add_rms_norm, rms_norm
from zllm.domain.rope import apply_rope, apply_rope_gptj, default_inv_freq, rope_cos_sin


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 6), k=st.integers(1, 96), eps=st.sampled_from([1e-6, 1e-5, 1e-2]), seed=st.integers(0, 2**16))
def test_rms_norm_matches_hf_llama(t, k, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * 3
    hf = LlamaRMSNorm(k, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(k, generator=g))
        expected = hf(x)
    # same f32 ops in the same order: tolerance 1e-6 only guards against summation-order changes
    torch.testing.assert_close(rms_norm(x, hf.weight.detach(), eps), expected, atol=1e-6, rtol=1e-6)


def test_rms_norm_accepts_low_precision_weight():
    x = torch.randn(3, 8)
    w = torch.randn(8).bfloat16()
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm(x, w.float(), 1e-6), atol=0, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 8),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 8, 16, 64]),
    theta=st.sampled_from([10000.0, 500000.0]),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_hf_llama(t, heads, head_dim, theta, seed):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (t,), generator=g)
    x = torch.randn(t, heads, head_dim, generator=g)
    config = LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    rotary = LlamaRotaryEmbedding(config)
    inv_freq = default_inv_freq(head_dim, theta)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, atol=0, rtol=0)

    hf_cos, hf_sin = rotary(x, positions[None])  # [1, T, D], halves duplicated
    hf_q = x.transpose(0, 1)[None]  # [1, H, T, D]
    expected, _ = apply_rotary_pos_emb(hf_q, hf_q, hf_cos, hf_sin)  # [1, H, T, D]

    cos, sin = rope_cos_sin(positions, inv_freq)
    torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin[0], atol=0, rtol=0)
    # x*cos - x2*sin vs x*cos + (-x2)*sin: one rounding apart at most
    torch.testing.assert_close(apply_rope(x, cos, sin), expected[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rope_position_zero_is_identity_and_norm_preserving():
    x = torch.randn(2, 3, 8)
    cos, sin = rope_cos_sin(torch.tensor([0, 7]), default_inv_freq(8, 10000.0))
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[0], x[0])
    # each (i, i + D/2) pair is rotated, so per-pair norms are kept
    pair_norm = lambda y: y[..., :4] ** 2 + y[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(x), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 6), heads=st.integers(1, 4), head_dim=st.sampled_from([2, 8, 64]), seed=st.integers(0, 2**16))
def test_gptj_rope_is_metas_complex_rotation(t, heads, head_dim, seed):
    # Meta's llama reference (model.py apply_rotary_emb): adjacent pairs as complex numbers
    # times exp(i * pos * inv_freq).
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (t,), generator=g)
    inv_freq = default_inv_freq(head_dim, 10000.0)
    x = torch.randn(t, heads, head_dim, generator=g)
    cos, sin = rope_cos_sin(positions, inv_freq)
    freqs = torch.polar(torch.ones(t, head_dim // 2), positions[:, None].float() * inv_freq[None, :])  # [T, D2]
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(t, heads, -1, 2)) * freqs[:, None, :]).flatten(2)
    torch.testing.assert_close(apply_rope_gptj(x, cos, sin), expected, atol=2e-5, rtol=1e-5)


def test_gptj_rope_equals_neox_rope_on_llama_cpp_permuted_rows():
    # convert_hf_to_gguf.py permutes HF Q/K rows from half-rotation to interleaved order:
    # interleaved index 2i <- i, 2i + 1 <- i + D/2.
    t, heads, d = 5, 3, 16
    x = torch.randn(t, heads, d)
    cos, sin = rope_cos_sin(torch.arange(t) * 37, default_inv_freq(d, 10000.0))
    to_interleaved = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=-1).flatten()
    torch.testing.assert_close(apply_rope_gptj(x[..., to_interleaved], cos, sin),
                               apply_rope(x, cos, sin)[..., to_interleaved])


def test_add_rms_norm_returns_the_normed_sum_and_the_sum():
    x, r, w = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    y, h = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(h, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, rms_norm(x + r, w, 1e-5), atol=0, rtol=0)
