"""Bad input to ``zllm run`` gets one clear ``error:`` line on stderr and exit status 2.

Every case runs the real console script in a subprocess. The bar (see README "Commands"):
exactly one stderr line starting with ``error: `` (``warning:`` lines aside), exit 2, no
traceback — and the line names the thing that is wrong. ``zllm --debug`` shows the traceback.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import MODEL_DIR, write_config

HF_DIR = MODEL_DIR / "hf"
GGUF_F32 = MODEL_DIR / "gguf" / "stories260K-f32.gguf"


def _truncate(path: Path, keep: int) -> int:
    """Cut ``path`` to ``keep`` bytes; return its original size."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(keep)
    return size


# ----------------------------------------------------------------------------- the checkpoint


def test_missing_model_path_names_the_resolved_path_and_the_key(tmp_path):
    cfg = write_config(tmp_path, "weights/nowhere")  # relative: resolved against the config's folder
    line = one_line_error(zllm("run", "--config", cfg))
    assert "model.path" in line
    assert str(tmp_path / "weights" / "nowhere") in line
    assert "does not exist" in line


def test_directory_that_is_not_a_checkpoint_says_no_config_json(tmp_path):
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, empty)))
    assert str(empty) in line
    assert "no config.json" in line


def test_truncated_safetensors_names_the_file_and_both_byte_counts(tmp_path):
    ckpt = tmp_path / "hf"
    shutil.copytree(HF_DIR, ckpt)
    weights = ckpt / "model.safetensors"
    keep = weights.stat().st_size - 1000
    original = _truncate(weights, keep)
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, ckpt)))
    assert str(weights) in line
    assert "truncated" in line
    assert str(original) in line, "the size the header promises"
    assert str(keep) in line, "the size the file has"


def test_truncated_gguf_names_the_file_and_says_it_is_truncated(tmp_path):
    gguf = tmp_path / "stories260K-f32.gguf"
    shutil.copy(GGUF_F32, gguf)
    _truncate(gguf, gguf.stat().st_size // 2)
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, gguf)))
    assert str(gguf) in line
    assert "truncated" in line


def test_gguf_missing_a_tensor_names_it_as_the_file_would(tmp_path):
    # It gave only the HF name, which no GGUF file contains.
    gguf_path = tmp_path / "no-attn-k.gguf"
    reader = gguf.GGUFReader(GGUF_F32)
    writer = gguf.GGUFWriter(gguf_path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != "blk.1.attn_k.weight":
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, gguf_path)))
    assert line == (f"error: {gguf_path}: tensor 'model.layers.1.self_attn.k_proj.weight': missing from the "
                    "checkpoint (which would name it 'blk.1.attn_k.weight')")


def test_safetensors_file_of_random_bytes_is_not_called_truncated(tmp_path):
    ckpt = tmp_path / "hf"
    shutil.copytree(HF_DIR, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + b"not json at all" * 10)  # header length far beyond the file
    line = one_line_error(zllm("card", ckpt))
    assert str(weights) in line
    assert "not a safetensors file" in line


def test_unknown_model_type_lists_the_known_architectures(tmp_path):
    ckpt = tmp_path / "hf"
    shutil.copytree(HF_DIR, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "not_a_llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, ckpt)))
    assert "'not_a_llama'" in line
    known = line.split("known architectures: ", 1)[1].split(";")[0].split(", ")
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2",
            "deepseek_v3"} <= set(known)


def test_unknown_backend_lists_installed_backends(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, backend={"name": "warp-drive"})
    line = one_line_error(zllm("run", "--config", cfg))
    assert "'warp-drive'" in line
    assert "loaded backends: cpu" in line


def test_backend_filtered_out_by_zllm_plugins_names_backend_and_reason():
    proc = zllm("run", "--config", "configs/stories260k-hf.yaml", env={"ZLLM_PLUGINS": "llama"})
    line = one_line_error(proc)
    assert "'cpu'" in line
    assert "filtered" in line and "ZLLM_PLUGINS" in line


def test_prompt_longer_than_context_window_names_both_lengths(tmp_path):
    cfg = write_config(tmp_path, HF_DIR)
    prompt = "Once upon a time there was a little dog. " * 80  # well over 512 tokens
    line = one_line_error(zllm("run", "--config", cfg, "--prompt", prompt, "--max-new-tokens", "1"))
    assert "prompt" in line
    assert "context window is 512 tokens" in line
    prompt_tokens = re.search(r"prompt is (\d+) tokens", line)
    assert prompt_tokens and int(prompt_tokens.group(1)) > 512, line


# ----------------------------------------------------------------------------- the config file


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text(f"schema_version: 1\nmodel:\n  path: {HF_DIR}\nbackend: [cpu\n  threads: 2\n")
    line = one_line_error(zllm("run", "--config", cfg))
    assert str(cfg) in line
    assert "line 5" in line


def test_unknown_config_key_names_its_path_and_suggests_the_right_one(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, runtime={"kv_cache": {"blok_size": 8}})
    line = one_line_error(zllm("run", "--config", cfg))
    assert line.startswith("error: runtime.kv_cache.blok_size:")
    assert "did you mean 'block_size'" in line


def test_wrong_typed_value_names_its_path_and_the_expected_type(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, runtime={"kv_cache": {"block_size": "big"}})
    line = one_line_error(zllm("run", "--config", cfg))
    assert line.startswith("error: runtime.kv_cache.block_size:")
    assert "positive int" in line and "'big'" in line


def test_negative_temperature_on_the_command_line_names_the_field(tmp_path):
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, HF_DIR), "--temperature", "-1"))
    assert "temperature" in line
    assert "-1" in line


def test_config_file_that_does_not_exist_names_it(tmp_path):
    missing = tmp_path / "no-such-config.yaml"
    line = one_line_error(zllm("run", "--config", missing))
    assert str(missing) in line


@pytest.mark.parametrize(("text", "got"), [("", "got an empty file"), ("- cpu\n- llama\n", "got a list")])
@pytest.mark.parametrize("command", [["run", "--config"], ["config", "validate"], ["config", "migrate"]])
def test_config_file_that_is_not_a_mapping_names_the_file_and_what_it_holds(tmp_path, command, text, got):
    cfg = tmp_path / "odd.yaml"
    cfg.write_text(text)
    line = one_line_error(zllm(*command, cfg))
    assert str(cfg) in line
    assert "expected a mapping of config sections" in line and got in line
    assert cfg.read_text() == text


# ----------------------------------------------------------------------------- --debug


def test_debug_shows_the_traceback_and_still_exits_2(tmp_path):
    proc = zllm("--debug", "run", "--config", write_config(tmp_path, tmp_path / "no-such-model"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ConfigError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: model.path: ")


def test_fp8_config_over_dense_tensors_is_one_error_naming_the_config(tmp_path):
    # A dequantized copy that kept its quantization_config ran dense under the "fp8" label.
    ckpt = tmp_path / "ckpt"
    shutil.copytree(HF_DIR, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(config))
    line = one_line_error(zllm("run", "--config", write_config(tmp_path, ckpt), "--max-new-tokens", "2"))
    assert str(ckpt / "config.json") in line
    assert "quant_method 'fp8', but no tensor is stored as it quantizes" in line
