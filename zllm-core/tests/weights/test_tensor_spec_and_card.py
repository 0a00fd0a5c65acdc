"""TensorSpec.check and ModelCard.to_yaml: the pure-data contracts of the weights layer."""

from __future__ import annotations

import io

import pytest
from ruamel.yaml import YAML

from zllm.spec.errors import TensorError
from zllm.spec.model_card import CardFile, ModelCard
from zllm.spec.tensor_spec import TensorSpec


def test_tensor_spec_accepts_matching_shape_and_format():
    spec = TensorSpec([4, 8], {"f32", "q8_0"})
    assert spec.shape == (4, 8) and spec.formats == frozenset({"f32", "q8_0"}) and not spec.optional
    spec.check("w", (4, 8), "q8_0", "model.gguf")
    TensorSpec((4, 8)).check("w", [4, 8], "bf16", "model.gguf")  # formats=None accepts any


def test_tensor_spec_mis_shaped_names_both_shapes():
    with pytest.raises(TensorError) as e:
        TensorSpec((4, 8)).check("model.norm.weight", (8, 4), "f32", "ckpt/model.safetensors")
    assert e.value.tensor == "model.norm.weight" and e.value.file == "ckpt/model.safetensors"
    assert "[4, 8]" in str(e.value) and "[8, 4]" in str(e.value)


def test_tensor_spec_wrong_format_lists_allowed():
    with pytest.raises(TensorError, match=r"'q4_0' not accepted; expected one of f16, f32"):
        TensorSpec((4, 8), frozenset({"f32", "f16"})).check("w", (4, 8), "q4_0", "f.gguf")


def test_tensor_spec_is_frozen_and_hashable():
    spec = TensorSpec((2,), optional=True)
    with pytest.raises(AttributeError):
        spec.shape = (3,)  # type: ignore[misc]
    assert hash(spec) == hash(TensorSpec([2], None, True))


def test_model_card_yaml_round_trips_through_a_yaml_parser():
    card = ModelCard("llama", "llama", 260032, "/m/hf", "hf", "MIT", [CardFile("config.json", 503, "ab" * 32)])
    data = YAML(typ="safe").load(io.StringIO(card.to_yaml()))
    assert list(data) == ["family", "architecture", "parameter_count", "source", "format", "license", "files"]
    assert data["parameter_count"] == 260032 and data["license"] == "MIT"
    assert data["files"] == [{"path": "config.json", "bytes": 503, "sha256": "ab" * 32}]


def test_model_card_rejects_unknown_format():
    with pytest.raises(ValueError):
        ModelCard("llama", "llama", 1, "/m", "onnx", "MIT", [])
