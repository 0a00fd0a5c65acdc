"""RoPE scaling references vs transformers' ``modeling_rope_utils`` (the installed 5.x), and
both config styles (``rope_scaling`` + ``rope_theta``, ``rope_parameters``)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from zllm.domain.rope import ROPE_TYPES, RopeParams, rope_cos_sin, rope_inv_freq, rope_params_from_config

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
}


def _config(params: dict, style: str) -> transformers.LlamaConfig:
    base = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=512)
    if style == "rope_parameters":
        return transformers.LlamaConfig(**base, rope_parameters={**params, "rope_theta": 50000.0})
    return transformers.LlamaConfig(**base, rope_scaling=dict(params), rope_theta=50000.0)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_and_attention_factor_equal_transformers(name, style):
    hf_cfg = _config(SCALINGS[name], style)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf_cfg, "cpu")
    # What zllm reads: the config.json that transformers writes.
    params = rope_params_from_config(hf_cfg.to_dict())
    assert params.theta == 50000.0 and params.rope_type == SCALINGS[name]["rope_type"]
    got, factor = rope_inv_freq(32, params)
    assert torch.equal(got, expected.float())
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_old_style_config_dict_reads_like_the_new_one():
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 64}
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, "max_position_embeddings": 64}
    assert rope_params_from_config(old) == rope_params_from_config(new) == RopeParams(
        rope_type="linear", theta=5e5, max_position_embeddings=64, factor=2.0, original_max_position_embeddings=64)


def test_yarn_attention_factor_scales_cos_and_sin():
    inv, factor = rope_inv_freq(16, RopeParams(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    pos = torch.arange(7)
    cos, sin = rope_cos_sin(pos, inv, factor)
    cos1, sin1 = rope_cos_sin(pos, inv)
    torch.testing.assert_close(cos, cos1 * factor)
    torch.testing.assert_close(sin, sin1 * factor)


def test_gguf_freq_factors_divide_the_frequencies():
    params = RopeParams(freq_factors=(1.0, 2.0, 4.0, 8.0))
    got, _ = rope_inv_freq(8, params)
    base, _ = rope_inv_freq(8, RopeParams())
    torch.testing.assert_close(got, base / torch.tensor([1.0, 2.0, 4.0, 8.0]))


@pytest.mark.parametrize("cfg, message", [
    ({"rope_scaling": {"rope_type": "longrope"}}, "RoPE type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_unsupported_rope_is_named_with_the_supported_types(cfg, message):
    with pytest.raises(ValueError, match=message) as e:
        rope_params_from_config(cfg)
    if "longrope" in message:
        assert ", ".join(ROPE_TYPES) in str(e.value)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "attention_factor": float("inf")},
    {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": float("nan")},
])
def test_non_positive_or_non_finite_scaling_value_is_named(rope):
    # YaRN's factor and attention_factor and llama3's frequency bounds were taken as they were:
    # a NaN or negative one gave NaN or negative frequencies and garbage text, with no error.
    bad = next(k for k, v in rope.items() if k != "rope_type" and k != "original_max_position_embeddings"
               and not (isinstance(v, float) and math.isfinite(v) and v > 0))
    with pytest.raises(ValueError) as e:
        rope_params_from_config({"max_position_embeddings": 256, "rope_parameters": rope})
    assert str(e.value) == f"RoPE type {rope['rope_type']!r}: {bad} {rope[bad]!r} is not a finite number > 0"


@pytest.mark.parametrize(("key", "value", "what"), [
    ("mscale", float("nan"), "a finite number"),
    ("mscale_all_dim", float("inf"), "a finite number"),
    ("beta_fast", float("nan"), "a finite number > 0"),
    ("beta_slow", -1.0, "a finite number > 0"),
])
def test_yarn_value_that_is_not_finite_is_named(key, value, what):
    # A NaN mscale ended the engine loop with a traceback ("router logits are not finite");
    # a NaN beta_fast raised "cannot convert float NaN to integer".
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 1.0, key: value}
    with pytest.raises(ValueError) as e:
        rope_params_from_config({"max_position_embeddings": 256, "rope_parameters": rope})
    assert str(e.value) == f"RoPE type 'yarn': {key} {value!r} is not {what}"
