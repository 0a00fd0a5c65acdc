"""load_weights accounts for every tensor; parameter_count; build_model_card."""

from __future__ import annotations

import hashlib
import io
import shutil

import pytest
import torch
from ruamel.yaml import YAML
from weights_helpers import STORIES_GGUF_F32, STORIES_GGUF_Q8_0, STORIES_HF, TINY_RANDOM_GGUF, copy_hf, open_checkpoint

from zllm.spec.errors import TensorError
from zllm.spec.tensor_spec import TensorSpec
from zllm.weights import QuantizedTensor, build_model_card, load_weights, parameter_count


def specs_of(ckpt, formats=None) -> dict[str, TensorSpec]:
    """Specs that exactly describe ``ckpt`` (what a model family would declare)."""
    return {n: TensorSpec(ckpt.tensor_shape(n), formats) for n in ckpt.tensor_names()}


def test_load_weights_returns_every_tensor_and_reports_progress():
    ckpt = open_checkpoint(STORIES_HF)
    seen: list[tuple[str, int]] = []
    weights = load_weights(ckpt, specs_of(ckpt), on_tensor=lambda n, b: seen.append((n, b)))
    assert list(weights) == ckpt.tensor_names() == [n for n, _ in seen]
    assert sum(b for _, b in seen) == 260032 * 4
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_optional_spec_may_be_absent():
    ckpt = open_checkpoint(STORIES_HF)
    specs = specs_of(ckpt) | {"lm_head.weight": TensorSpec((512, 64), optional=True)}
    assert "lm_head.weight" not in load_weights(ckpt, specs)


def test_missing_tensor_is_named():
    ckpt = open_checkpoint(STORIES_HF)
    specs = specs_of(ckpt) | {"lm_head.weight": TensorSpec((512, 64)), "model.x.weight": TensorSpec((1,))}
    with pytest.raises(TensorError, match=r"missing from the checkpoint \(and 1 more: model.x.weight\)") as e:
        load_weights(ckpt, specs)
    assert e.value.tensor == "lm_head.weight" and e.value.file == str(STORIES_HF)


def test_unused_tensor_is_named_with_its_file():
    ckpt = open_checkpoint(STORIES_GGUF_F32)
    specs = specs_of(ckpt)
    for name in ("model.layers.4.mlp.up_proj.weight", "model.layers.4.mlp.down_proj.weight"):
        del specs[name]
    with pytest.raises(TensorError, match=r"unused \(not part of the model\)") as e:
        load_weights(ckpt, specs)
    assert e.value.tensor in ("model.layers.4.mlp.up_proj.weight", "model.layers.4.mlp.down_proj.weight")
    assert e.value.file == str(STORIES_GGUF_F32) and "1 more" in str(e.value)


def test_mis_shaped_tensor_is_named():
    ckpt = open_checkpoint(STORIES_HF)
    specs = specs_of(ckpt) | {"model.layers.1.self_attn.k_proj.weight": TensorSpec((64, 64))}
    with pytest.raises(TensorError, match=r"mis-shaped: expected shape \[64, 64\], got \[32, 64\]") as e:
        load_weights(ckpt, specs)
    assert e.value.tensor == "model.layers.1.self_attn.k_proj.weight"
    assert e.value.file == str(STORIES_HF / "model.safetensors")


@pytest.mark.parametrize("change", ["mis-shaped", "unused"])
def test_gguf_tensor_error_gives_the_name_the_file_uses_too(change):
    # Only the HF name was given: a GGUF user searching the file for it found nothing.
    ckpt = open_checkpoint(STORIES_GGUF_F32)
    name = "model.layers.1.self_attn.k_proj.weight"
    specs = specs_of(ckpt)
    if change == "mis-shaped":
        specs[name] = TensorSpec((64, 64))
    else:
        del specs[name]
    with pytest.raises(TensorError, match=change) as e:
        load_weights(ckpt, specs)
    assert e.value.tensor == name and e.value.file_tensor == "blk.1.attn_k.weight"
    assert str(e.value).startswith(f"{STORIES_GGUF_F32}: tensor '{name}' (in the file: 'blk.1.attn_k.weight'): ")


def test_tensor_missing_from_a_gguf_file_gives_the_name_the_file_would_use():
    ckpt = open_checkpoint(STORIES_GGUF_F32)
    specs = specs_of(ckpt) | {"model.layers.1.self_attn.q_proj.bias": TensorSpec((64,))}
    with pytest.raises(TensorError) as e:
        load_weights(ckpt, specs)
    assert e.value.tensor == "model.layers.1.self_attn.q_proj.bias"
    assert str(e.value).endswith("missing from the checkpoint (which would name it 'blk.1.attn_q.bias')")


def test_hf_tensor_error_names_the_tensor_once():
    ckpt = open_checkpoint(STORIES_HF)
    with pytest.raises(TensorError) as e:
        load_weights(ckpt, specs_of(ckpt) | {"model.layers.1.self_attn.k_proj.weight": TensorSpec((64, 64))})
    assert "in the file" not in str(e.value) and e.value.file_tensor is None


def test_wrong_format_is_checked_after_dtype_conversion():
    ckpt = open_checkpoint(STORIES_HF)
    with pytest.raises(TensorError, match="format 'f32' not accepted; expected one of f16"):
        load_weights(ckpt, specs_of(ckpt, {"f16"}))
    weights = load_weights(ckpt, specs_of(ckpt, {"f16"}), dtype="f16")
    assert all(w.dtype == torch.float16 for w in weights.values())


def test_dtype_converts_dense_only():
    ckpt = open_checkpoint(STORIES_GGUF_Q8_0)
    weights = load_weights(ckpt, specs_of(ckpt), dtype="bf16")
    assert isinstance(weights["model.embed_tokens.weight"], QuantizedTensor)
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # stored f16
    assert weights["model.norm.weight"].dtype == torch.bfloat16  # stored f32
    with pytest.raises(ValueError, match="unknown load dtype 'f8'"):
        load_weights(ckpt, specs_of(ckpt), dtype="f8")


def test_parameter_count_is_format_independent():
    counts = {parameter_count(open_checkpoint(p)) for p in (STORIES_HF, STORIES_GGUF_F32, STORIES_GGUF_Q8_0)}
    assert counts == {64 * 512 + 64 + 5 * (2 * 64 + 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 172)}


@pytest.mark.parametrize("path", [STORIES_HF, STORIES_GGUF_Q8_0, TINY_RANDOM_GGUF], ids=["hf", "q8_0", "tiny-random"])
def test_model_card_hashes_every_file_and_finds_the_license(path, tiny_random):
    ckpt = tiny_random if path == TINY_RANDOM_GGUF else open_checkpoint(path)
    card = build_model_card(ckpt, "llama")
    assert card.license == "MIT"  # stories260k/LICENSE (parent of hf/, gguf/); LICENSE.ollama beside the file
    assert card.family == "llama" and card.architecture == "llama" and card.format == ckpt.format
    assert card.source == str(path) and card.parameter_count == parameter_count(ckpt)
    assert len(card.files) == len(ckpt.files)
    base = path if path.is_dir() else path.parent
    for entry in card.files:
        data = (base / entry.path).read_bytes()
        assert entry.bytes == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    parsed = YAML(typ="safe").load(io.StringIO(card.to_yaml()))
    assert parsed["files"][0]["sha256"] == card.files[0].sha256


def test_model_card_license_fallbacks(tmp_path):
    hf = copy_hf(tmp_path / "nolicense" / "hf")
    assert build_model_card(open_checkpoint(hf), "llama").license == "unknown"
    (hf / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a model\n")
    assert build_model_card(open_checkpoint(hf), "llama").license == "apache-2.0"
    (hf / "LICENSE.txt").write_text("Some Custom License v1\n\nterms")
    assert build_model_card(open_checkpoint(hf), "llama").license == "Some Custom License v1"
    gguf_copy = tmp_path / "alone" / "m.gguf"
    gguf_copy.parent.mkdir()
    shutil.copy(STORIES_GGUF_F32, gguf_copy)
    assert build_model_card(open_checkpoint(gguf_copy), "llama").license == "unknown"


def test_model_card_uses_gguf_general_license(tmp_path):
    import gguf as gguf_pkg
    import numpy as np
    from weights_helpers import tiny_llama_kv, tiny_llama_tensors, write_gguf

    kv = tiny_llama_kv() | {"general.license": ("apache-2.0", gguf_pkg.GGUFValueType.STRING)}
    (tmp_path / "d").mkdir()
    path = write_gguf(tmp_path / "d" / "m.gguf", "llama", kv, tiny_llama_tensors(np.random.default_rng(0)))
    assert build_model_card(open_checkpoint(path), "llama").license == "apache-2.0"
