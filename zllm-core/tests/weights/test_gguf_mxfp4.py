"""ggml's MXFP4 blocks (what llama.cpp's converter writes for gpt-oss's experts) repacked at load
into the registry's ``mxfp4`` parts decode exactly as the ``gguf`` package decodes the blocks."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.domain.linear import weight_to_f32
from zllm.weights.gguf_file import mxfp4_from_ggml


@settings(max_examples=25, deadline=None)
@given(lead=st.sampled_from([(), (3,)]), n=st.integers(1, 5), blocks=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_repacked_ggml_mxfp4_decodes_as_the_gguf_package(lead, n, blocks, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*lead, n, blocks, 17), dtype=np.uint8)  # E8M0 byte + 16 nibble bytes
    raw[..., 0] = rng.integers(100, 150, size=raw.shape[:-1])  # finite scales (255 is NaN)
    k = blocks * 32
    weight = mxfp4_from_ggml(torch.from_numpy(raw.reshape(*lead, n, -1)), (*lead, n, k))
    assert weight.fmt == "mxfp4" and weight.parts["qweight"].shape == (*lead, n, k // 2)
    expected = gguf.quants.dequantize(raw.reshape(-1, blocks * 17), gguf.GGMLQuantizationType.MXFP4)
    ours = torch.stack([weight_to_f32(weight[i]) for i in range(lead[0])]) if lead else weight_to_f32(weight)
    np.testing.assert_array_equal(ours.numpy().reshape(-1, k), expected)
