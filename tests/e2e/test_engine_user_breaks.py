"""Inputs a user threw at ``zllm.Engine`` that once crashed it or gave wrong output.

Each case is the real engine on the shipped stories260K model (no mocks). A user error is
a :class:`~zllm.spec.errors.ZllmError` (the CLI prints it as one ``error:`` line, exit 2)
whose message names the bad thing; a valid but extreme request gives sensible tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import zllm
from tests.cli.conftest import assert_run_ends_with_one_error, put_nan_in_weight
from tests.conftest import CONFIGS, MODEL_DIR, write_config
from zllm.spec.errors import CheckpointError, ConfigError, RequestError

HF_DIR = MODEL_DIR / "hf"
GGUF_F32 = MODEL_DIR / "gguf" / "stories260K-f32.gguf"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine():
    return zllm.Engine.from_config(CONFIGS / "stories260k-hf.yaml")


# ----------------------------------------------------------------------- extreme sampling values


def _greedy(engine, n: int = 6) -> list[int]:
    return engine.generate({"prompt": PROMPT, "max_tokens": n, "temperature": 0.0})["token_ids"]


@pytest.mark.parametrize("extreme", [
    {"temperature": 1e-300},  # rounds to 0 in f32: logits / 0 -> NaN -> token 0 every step
    {"temperature": 1.0, "top_p": 5e-324},  # rounds to 0 in f32: even the top token was dropped
    {"temperature": 1e-7, "top_p": 1e-40},
])
def test_vanishing_temperature_or_top_p_picks_the_greedy_tokens(engine, extreme):
    out = engine.generate({"prompt": PROMPT, "max_tokens": 6, "seed": 3, **extreme})
    assert out["token_ids"] == _greedy(engine), extreme


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_extreme_repetition_penalty_never_yields_nan_rows(engine, penalty):
    # 1e-300 divided positive logits by an f32 zero (inf, NaN), so every token came out as id 0.
    for temperature in (0.0, 1.0):
        ids = engine.generate({"prompt": PROMPT, "max_tokens": 6, "seed": 1, "temperature": temperature,
                               "repetition_penalty": penalty})["token_ids"]
        assert ids != [0] * 6, (penalty, temperature)


def test_tiny_repetition_penalty_repeats_the_prompt_like_a_small_one(engine):
    small = engine.generate({"prompt": PROMPT, "max_tokens": 6, "repetition_penalty": 1e-3})["token_ids"]
    tiny = engine.generate({"prompt": PROMPT, "max_tokens": 6, "repetition_penalty": 1e-300})["token_ids"]
    assert tiny == small


# ----------------------------------------------------------------------- text that is not Unicode


@pytest.mark.parametrize("request_, field", [
    ({"prompt": "hi \udcff"}, "prompt"),  # how Python decodes a non-UTF-8 argv or stdin byte
    ({"prompt": PROMPT, "stop": ["\ud800"]}, "stop"),
    ({"messages": [{"role": "user", "content": "a\udcfe"}]}, "messages[0].content"),
])
def test_lone_surrogates_are_a_request_error_naming_the_field(engine, request_, field):
    with pytest.raises(RequestError) as info:
        engine.generate({"max_tokens": 2, **request_})
    assert info.value.field == field
    assert "not valid Unicode text" in str(info.value)


# ----------------------------------------------------------------------- Engine.from_config


@pytest.mark.parametrize("bad", [None, 5, b"configs/stories260k-hf.yaml"])
def test_from_config_of_a_wrong_type_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=f"got {type(bad).__name__}"):
        zllm.Engine.from_config(bad)


def test_from_config_accepts_a_mapping(engine):
    other = zllm.Engine.from_config({"model": {"path": str(HF_DIR)}, "backend": {"name": "cpu"}})
    assert other.generate({"prompt": PROMPT, "max_tokens": 6})["token_ids"] == _greedy(engine)


def test_kv_cache_too_large_to_allocate_names_the_key(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, runtime={"kv_cache": {"num_blocks": 10**11}})
    with pytest.raises(ConfigError, match="cannot be allocated") as info:
        zllm.Engine.from_config(cfg)
    assert info.value.path == "runtime.kv_cache.num_blocks"


# ----------------------------------------------------------------------- HF checkpoint files


def _hf_copy(tmp_path: Path, file: str, edit) -> Path:
    ckpt = tmp_path / "hf"
    shutil.copytree(HF_DIR, ckpt)
    data = json.loads((ckpt / file).read_text())
    edit(data)
    (ckpt / file).write_text(json.dumps(data))
    return ckpt


@pytest.mark.parametrize("key, value, expect", [
    ("rope_theta", 0, "rope_theta 0.0 is not a finite number > 0"),  # was AssertionError
    ("rope_theta", None, "rope_theta None is not a number"),  # was TypeError
    ("max_position_embeddings", 0, "max_position_embeddings 0 is not a positive integer"),  # AssertionError
    ("num_key_value_heads", 0, "num_key_value_heads 0 is not a positive integer"),  # blamed a tensor
    ("num_hidden_layers", -1, "num_hidden_layers -1 is not a positive integer"),  # "unused tensors"
    ("rms_norm_eps", -1, "rms_norm_eps -1 is not a finite number >= 0"),  # ran, printed nothing
    ("head_dim", 7, "head_dim 7 is odd"),
    ("rope_scaling", {"rope_type": "linear", "factor": -1}, "factor -1 is not a finite number > 0"),  # ran
    ("rope_scaling", "x", "rope_scaling 'x' is not an object"),  # "dictionary update sequence ..."
    ("tie_word_embeddings", "false", "tie_word_embeddings 'false' is not true or false"),  # read as true
    ("attention_bias", "no", "attention_bias 'no' is not true or false"),  # read as true
])
def test_bad_config_json_value_names_the_key(tmp_path, key, value, expect):
    ckpt = _hf_copy(tmp_path, "config.json", lambda c: c.__setitem__(key, value))
    with pytest.raises(CheckpointError) as info:
        zllm.Engine.from_config(write_config(tmp_path, ckpt))
    assert expect in str(info.value)


@pytest.mark.parametrize("eos", ["x", [1, None], True])
def test_bad_generation_config_eos_names_the_file(tmp_path, eos):
    ckpt = _hf_copy(tmp_path, "generation_config.json", lambda c: c.__setitem__("eos_token_id", eos))
    with pytest.raises(CheckpointError, match="eos_token_id") as info:  # was ValueError / TypeError
        zllm.Engine.from_config(write_config(tmp_path, ckpt))
    assert info.value.file == str(ckpt / "generation_config.json")


def test_bad_chat_template_names_tokenizer_config_json(tmp_path):
    ckpt = _hf_copy(tmp_path, "tokenizer_config.json", lambda c: c.__setitem__("chat_template", 5))
    with pytest.raises(CheckpointError, match="chat_template") as info:
        zllm.Engine.from_config(write_config(tmp_path, ckpt))
    assert info.value.file == str(ckpt / "tokenizer_config.json")  # was tokenizer.json


# ----------------------------------------------------------------------- GGUF metadata


def _gguf_with(dst: Path, key: str, value, vtype: gguf.GGUFValueType) -> Path:
    """The shipped f32 GGUF with metadata ``key`` replaced."""
    reader = gguf.GGUFReader(GGUF_F32)
    writer = gguf.GGUFWriter(dst, "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == key:
            writer.add_key_value(name, value, vtype)
            continue
        ftype = field.types[0]
        sub = field.types[-1] if ftype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), ftype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("key, value, vtype", [
    ("llama.block_count", "five", gguf.GGUFValueType.STRING),  # was TypeError
    ("llama.context_length", -1, gguf.GGUFValueType.INT32),  # was AssertionError
    ("llama.rope.freq_base", 0.0, gguf.GGUFValueType.FLOAT32),  # was AssertionError
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), gguf.GGUFValueType.FLOAT32),  # ran, empty output
])
def test_bad_gguf_metadata_value_names_the_key(tmp_path, key, value, vtype):
    path = _gguf_with(tmp_path / "m.gguf", key, value, vtype)
    with pytest.raises(CheckpointError, match=f"metadata '{key}' is .*; expected a number > 0"):
        zllm.Engine.from_config(write_config(tmp_path, path))


def test_nan_in_a_dense_weight_ends_zllm_run_with_one_error_line_and_exit_3(tmp_path):
    # The logits of every step are checked (one sum): a NaN weight made every token id 0 and
    # `zllm run` printed empty text with exit 0.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(HF_DIR, ckpt)
    put_nan_in_weight(ckpt, "layers.0.mlp.down_proj.weight")
    assert_run_ends_with_one_error(write_config(tmp_path, ckpt), "logits are not finite")
