"""HF checkpoints: single-file and sharded safetensors, zero-copy mapping, damaged files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from weights_helpers import STORIES_HF, assert_backed_by, copy_hf, needs_proc, open_checkpoint

from zllm.spec.errors import CheckpointError, TensorError


def test_stories_hf_config_and_tensors():
    ckpt = open_checkpoint(STORIES_HF)
    assert ckpt.format == "hf" and ckpt.architecture == "llama" and ckpt.metadata == {}
    assert ckpt.config["hidden_size"] == 64 and ckpt.config["num_key_value_heads"] == 4
    assert ckpt.generation_config["eos_token_id"] == [2, 1]
    names = ckpt.tensor_names()
    assert len(names) == 47 and "lm_head.weight" not in names
    assert ckpt.tensor_shape_format("model.layers.0.self_attn.k_proj.weight") == ((32, 64), "f32")
    w = ckpt.tensor("model.embed_tokens.weight")
    assert w.dtype == torch.float32 and w.shape == (512, 64)
    assert ckpt.file_of("model.norm.weight") == STORIES_HF / "model.safetensors"
    assert {p.name for p in ckpt.files} == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
    }  # fmt: skip


@needs_proc
def test_hf_tensors_are_views_of_the_file_mapping():
    ckpt = open_checkpoint(STORIES_HF)
    for name in ckpt.tensor_names():
        assert_backed_by(ckpt.tensor(name), STORIES_HF / "model.safetensors")


@needs_proc
def test_hf_tensor_writes_do_not_reach_the_file(tmp_path):
    ckpt = open_checkpoint(copy_hf(tmp_path / "hf"))
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()
    ckpt.tensor("model.norm.weight").add_(1.0)  # copy-on-write page, private to this process
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before


def test_sharded_checkpoint_loads_every_tensor(sharded_hf):
    path, state = sharded_hf
    ckpt = open_checkpoint(path)
    shards = {p.name for p in ckpt.files if p.suffix == ".safetensors"}
    assert len(shards) > 1
    assert set(ckpt.tensor_names()) == set(state)
    for name, expected in state.items():
        assert torch.equal(ckpt.tensor(name), expected), name
        assert ckpt.file_of(name).name in shards


def test_sharded_checkpoint_missing_shard_is_named(sharded_hf, tmp_path):
    path = shutil.copytree(sharded_hf[0], tmp_path / "ckpt")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard named in model.safetensors.index.json") as e:
        open_checkpoint(path)
    assert e.value.file == str(shard)


def test_sharded_checkpoint_tensor_absent_from_its_shard(sharded_hf, tmp_path):
    path = shutil.copytree(sharded_hf[0], tmp_path / "ckpt")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = next(iter(index["weight_map"].values()))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TensorError, match="listed in model.safetensors.index.json but absent") as e:
        open_checkpoint(path)
    assert e.value.tensor == "model.layers.9.ghost.weight"


def test_truncated_safetensors_names_file_and_byte_counts(tmp_path):
    path = copy_hf(tmp_path / "hf")
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 1000])
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert e.value.file == str(weights)
    assert f"promises {size} bytes" in str(e.value) and f"has {size - 1000} bytes" in str(e.value)


def test_safetensors_cut_inside_header(tmp_path):
    path = copy_hf(tmp_path / "hf")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"truncated: the header promises \d+ bytes, the file has 100 bytes"):
        open_checkpoint(path)


def test_corrupt_safetensors_header(tmp_path):
    path = copy_hf(tmp_path / "hf")
    weights = path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:20] = b"not json !!!"
    weights.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as e:
        open_checkpoint(path)
    assert e.value.file == str(weights)


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a checkpoint directory: no config.json") as e:
        open_checkpoint(tmp_path)
    assert "model.safetensors" in str(e.value) and e.value.file == str(tmp_path)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no weights: expected model.safetensors or "
                                              r"model.safetensors.index.json; found pytorch_model.bin"):
        open_checkpoint(tmp_path)


def test_missing_path_and_unknown_format(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory") as e:
        open_checkpoint(tmp_path / "nope")
    assert e.value.file == str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="unknown checkpoint format 'onnx'; expected one of auto, hf, gguf"):
        open_checkpoint(STORIES_HF, "onnx")


def test_unsupported_safetensors_dtype_is_refused_with_alternatives(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.zeros(2, 2, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.tensor_shape("w") == (2, 2)
    with pytest.raises(TensorError, match="stored as I64; supported safetensors dtypes: F32, F16, BF16"):
        ckpt.tensor("w")


def test_hf_load_tokenizer():
    tokenizer = open_checkpoint(STORIES_HF).load_tokenizer()
    assert tokenizer.encode("Zoo") == [1, 410, 469, 347]  # shared/models/README.md
    assert set(tokenizer.eos_token_ids) == {2, 1}  # generation_config.json's list
