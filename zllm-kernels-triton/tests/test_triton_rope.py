"""RoPE kernel (neox and gptj layouts) vs the f32 references, in the interpreter.

``cos``/``sin`` come from the core's RoPE tables (``rope_inv_freq`` + ``rope_cos_sin``) for
default and scaled RoPE (linear, llama3, YaRN with its attention factor), showing that the
kernel needs nothing per variant. ``x`` is a strided view (the Q part of a fused QKV
output, or a heads-major tensor).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.rope import apply_rope, apply_rope_gptj
from zllm.plugin_api import RopeParams, rope_cos_sin, rope_inv_freq
from zllm_kernels_triton.rope import rope, rope_gptj
from zllm_kernels_triton.tuning import Tuning

ROPE_PARAMS = {
    "default": RopeParams(),
    "linear": RopeParams(rope_type="linear", factor=2.0),
    "llama3": RopeParams(rope_type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=64,
                         max_position_embeddings=4096),
    "yarn": RopeParams(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, max_position_embeddings=256),
}
LAYOUTS = {"neox": (rope, apply_rope), "gptj": (rope_gptj, apply_rope_gptj)}


def strided_heads(t: int, h: int, d: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """f32 ``[t, h, d]`` laid out as the Q part of a fused ``[t, (h + 2) * d]`` projection, or heads-major."""
    if layout == "fused_qkv":
        return torch.randn(t, (h + 2) * d, generator=g)[:, : h * d].view(t, h, d)
    return torch.randn(h, t, d, generator=g).transpose(0, 1)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 9),
    h=st.integers(1, 4),
    d=st.sampled_from([8, 16, 32]),
    pair_layout=st.sampled_from(sorted(LAYOUTS)),
    rope_type=st.sampled_from(sorted(ROPE_PARAMS)),
    block_h=st.sampled_from([1, 2, 4]),
    block_pairs=st.sampled_from([2, 4, 64]),
    x_layout=st.sampled_from(["fused_qkv", "heads_major"]),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_reference(t, h, d, pair_layout, rope_type, block_h, block_pairs, x_layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = strided_heads(t, h, d, x_layout, g)
    positions = torch.randint(0, 256, (t,), generator=g)
    inv_freq, attention_factor = rope_inv_freq(d, ROPE_PARAMS[rope_type])
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
    kernel, reference = LAYOUTS[pair_layout]
    got = kernel(x, cos, sin, tuning=Tuning(rope_block_h=block_h, rope_block_pairs=block_pairs))
    assert got.shape == (t, h, d) and got.is_contiguous()
    # the same two products and one add per element as the reference: 1e-4 covers FMA contraction
    torch.testing.assert_close(got, reference(x.contiguous(), cos, sin), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pair_layout", sorted(LAYOUTS))
def test_yarn_attention_factor_reaches_the_output(pair_layout):
    # at position 0 the rotation is the identity, so the output is x times YaRN's mscale
    inv_freq, attention_factor = rope_inv_freq(8, ROPE_PARAMS["yarn"])
    assert attention_factor > 1.0
    cos, sin = rope_cos_sin(torch.zeros(1, dtype=torch.int64), inv_freq, attention_factor)
    x = torch.randn(1, 2, 8)
    kernel, _ = LAYOUTS[pair_layout]
    torch.testing.assert_close(kernel(x, cos, sin), x * attention_factor, atol=1e-6, rtol=1e-6)


def test_layouts_pair_different_elements():
    # a quarter turn moves element 0 to its partner: D/2 for neox, 1 for gptj
    x = torch.zeros(1, 1, 8)
    x[0, 0, 0] = 1.0
    cos, sin = torch.zeros(1, 4), torch.ones(1, 4)
    assert rope(x, cos, sin)[0, 0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert rope_gptj(x, cos, sin)[0, 0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
