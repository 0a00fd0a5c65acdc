"""The inspection commands, run as a user would: ``card``, ``config validate|migrate``,
``plugins`` and ``run --explain``. Expected values are computed here independently
(hashlib, the safetensors header, the gguf reader), never taken from zllm."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from tests.cli.conftest import one_line_error, zllm
from tests.conftest import CONFIGS, MODEL_DIR, write_config
from zllm_backend_cpu.kernels.native import unavailable_reason as native_unavailable

HF_DIR = MODEL_DIR / "hf"
GGUF_Q8_0 = MODEL_DIR / "gguf" / "stories260K-q8_0.gguf"


def _yaml(text: str):
    return YAML(typ="safe", pure=True).load(io.StringIO(text))


def _safetensors_parameter_count(ckpt: Path) -> int:
    """Elements of every tensor in the header; a stored tied lm_head counts once (not at all)."""
    with (ckpt / "model.safetensors").open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    tied = json.loads((ckpt / "config.json").read_text()).get("tie_word_embeddings", False)
    return sum(
        math.prod(entry["shape"])
        for name, entry in header.items()
        if name != "__metadata__" and not (tied and name == "lm_head.weight")
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- zllm card


def test_card_of_hf_checkpoint_reports_family_size_license_and_file_hashes():
    proc = zllm("card", HF_DIR)
    assert proc.returncode == 0, proc.stderr
    card = _yaml(proc.stdout)
    assert card["family"] == "llama"
    assert card["architecture"] == "llama"
    assert card["format"] == "hf"
    assert card["license"] == "MIT"
    assert card["parameter_count"] == _safetensors_parameter_count(HF_DIR) == 260032
    listed = {entry["path"]: entry for entry in card["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)
    for name, entry in listed.items():
        assert entry["sha256"] == _sha256(HF_DIR / name), name
        assert entry["bytes"] == (HF_DIR / name).stat().st_size, name


def test_card_of_q8_0_gguf_reports_the_same_model_with_the_file_hash():
    from gguf import GGUFReader

    proc = zllm("card", GGUF_Q8_0)
    assert proc.returncode == 0, proc.stderr
    card = _yaml(proc.stdout)
    assert card["family"] == "llama"
    assert card["architecture"] == "llama"
    assert card["format"] == "gguf"
    assert card["license"] == "MIT"  # from the LICENSE beside gguf/ and hf/
    gguf_count = sum(int(t.n_elements) for t in GGUFReader(GGUF_Q8_0).tensors)
    assert card["parameter_count"] == gguf_count == _safetensors_parameter_count(HF_DIR)
    assert card["files"] == [
        {"path": GGUF_Q8_0.name, "bytes": GGUF_Q8_0.stat().st_size, "sha256": _sha256(GGUF_Q8_0)}
    ]


# ----------------------------------------------------------------------------- zllm config


def test_config_validate_accepts_the_shipped_config():
    proc = zllm("config", "validate", CONFIGS / "stories260k-hf.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


def test_config_validate_rejects_a_bad_key_naming_its_path(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, runtime={"max_num_seqs": 0})
    line = one_line_error(zllm("config", "validate", cfg))
    assert line.startswith("error: runtime.max_num_seqs:")


SCHEMA_0 = """\
# my stories config, written for zllm 0.0
model:
  checkpoint: {path}   # the shipped weights
backend:
  name: cpu  # no GPU here
# how to sample
sampling:
  temperature: 0.7  # a little creative
  max_tokens: 32    # short stories only
"""


@pytest.fixture
def schema_0_file(tmp_path) -> Path:
    old = tmp_path / "old.yaml"
    old.write_text(SCHEMA_0.format(path=HF_DIR))
    return old


def _assert_migrated(text: str) -> None:
    for comment in ("# my stories config, written for zllm 0.0", "# the shipped weights", "# no GPU here",
                    "# how to sample", "# a little creative", "# short stories only"):
        assert comment in text, f"lost comment {comment!r}:\n{text}"
    data = _yaml(text)
    assert data["schema_version"] == 1
    assert data["model"] == {"path": str(HF_DIR)}
    assert data["generation"] == {"temperature": 0.7, "max_new_tokens": 32}
    assert "sampling" not in data


def test_config_migrate_prints_current_schema_keeping_comments_and_it_validates(tmp_path, schema_0_file):
    before = schema_0_file.read_text()
    proc = zllm("config", "migrate", schema_0_file)
    assert proc.returncode == 0, proc.stderr
    _assert_migrated(proc.stdout)
    assert schema_0_file.read_text() == before, "without --in-place the file is left alone"
    new = tmp_path / "new.yaml"
    new.write_text(proc.stdout)
    check = zllm("config", "validate", new)
    assert check.returncode == 0, check.stderr


def test_config_migrate_in_place_rewrites_the_file(schema_0_file):
    printed = zllm("config", "migrate", schema_0_file).stdout
    proc = zllm("config", "migrate", "--in-place", schema_0_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert schema_0_file.read_text() == printed
    _assert_migrated(schema_0_file.read_text())
    assert zllm("config", "migrate", schema_0_file).stdout == printed, "migrating again changes nothing"


def test_config_migrate_of_a_conflicting_file_names_the_old_key(tmp_path):
    old = tmp_path / "both.yaml"
    old.write_text(f"model:\n  checkpoint: {HF_DIR}\n  path: {HF_DIR}\n")
    line = one_line_error(zllm("config", "migrate", old))
    assert line.startswith("error: model.checkpoint:")
    assert old.read_text() == f"model:\n  checkpoint: {HF_DIR}\n  path: {HF_DIR}\n"


# ----------------------------------------------------------------------------- zllm plugins

PLUGIN_COLUMNS = ["NAME", "DISTRIBUTION", "VERSION", "KIND", "STATUS", "REASON"]


def parse_plugin_table(stdout: str) -> list[dict[str, str]]:
    """Rows of the ``zllm plugins`` table, split at the header's column starts."""
    header, *rows = stdout.splitlines()
    assert header.split() == PLUGIN_COLUMNS, header
    starts = [header.index(c) for c in PLUGIN_COLUMNS]
    bounds = list(zip(starts, starts[1:] + [None], strict=True))
    return [{c: row[a:b].strip() for c, (a, b) in zip(PLUGIN_COLUMNS, bounds, strict=True)}
            for row in rows if row.strip()]


def test_plugins_table_lists_cpu_and_llama_as_loaded():
    proc = zllm("plugins")
    assert proc.returncode == 0, proc.stderr
    rows = {r["NAME"]: r for r in parse_plugin_table(proc.stdout)}
    assert rows["cpu"]["DISTRIBUTION"] == "zllm-backend-cpu"
    assert rows["cpu"]["KIND"] == "backend:cpu"
    assert rows["llama"]["DISTRIBUTION"] == "zllm-model-llama"
    assert rows["llama"]["KIND"] == ("family:llama, family:mistral, family:qwen2, family:qwen3, family:mixtral, "
                                     "family:qwen2_moe, family:qwen3_moe")
    for name in ("cpu", "llama"):
        assert rows[name]["VERSION"] == "0.1.0"
        assert rows[name]["STATUS"] == "loaded"
        assert rows[name]["REASON"] == ""


def test_plugins_json_is_machine_readable():
    proc = zllm("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert {"cpu", "llama"} <= set(rows)
    for row in rows.values():
        assert {"distribution", "version", "kind", "status", "reason"} <= set(row)
    assert rows["cpu"]["status"] == rows["llama"]["status"] == "loaded"


# ----------------------------------------------------------------------------- zllm run --explain

EXPLAIN_LINE = re.compile(r"^\s+(?P<cap>\w+\[[\w]+\])\s+-> (?P<kernel>[\w.]+:\w+)\s+\((?P<reason>.+)\)$")


def explain_lines(stderr: str) -> dict[str, tuple[str, str]]:
    """capability -> (kernel, reason), asserting each capability is explained once."""
    found = [m for m in map(EXPLAIN_LINE.match, stderr.splitlines()) if m]
    caps = [m["cap"] for m in found]
    assert len(caps) == len(set(caps)), f"a capability explained twice:\n{stderr}"
    return {m["cap"]: (m["kernel"], m["reason"]) for m in found}


def test_explain_prints_the_kernel_chosen_for_each_capability_and_why():
    proc = zllm("run", "--config", CONFIGS / "stories260k-gguf-q8_0.yaml", "--explain", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the generation still runs"
    lines = explain_lines(proc.stderr)
    if native_unavailable() is None:  # the CPU backend's native GEMV library was built and loads
        assert lines["linear[q8_0]"][0] == "zllm_backend_cpu.kernels.gemv:linear_gemv"
        assert "native row kernels: AVX" in lines["linear[q8_0]"][1], "the ISA level in use is named"
    else:
        assert lines["linear[q8_0]"][0] == "zllm_backend_cpu.kernels.linear:linear_quant"
        assert "native kernels unavailable" in lines["linear[q8_0]"][1]
    assert lines["embedding[q8_0]"][0] == "zllm_backend_cpu.kernels.linear:embedding_quant"
    for op in ("attention", "rms_norm", "rope", "silu_mul"):
        assert any(cap.startswith(f"{op}[") for cap in lines), f"no line for {op}:\n{proc.stderr}"
    for cap, (kernel, reason) in lines.items():
        assert kernel.startswith("zllm_backend_cpu."), (cap, kernel)
        assert reason.strip(), cap
    assert "explain" not in proc.stdout and "->" not in proc.stdout, "explanations go to stderr"


def test_explain_shows_the_reference_forced_by_config(tmp_path):
    cfg = write_config(tmp_path, GGUF_Q8_0, backend={"force_reference": ["linear"]},
                       generation={"stop_token_ids": [1]})
    proc = zllm("run", "--config", cfg, "--explain", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    lines = explain_lines(proc.stderr)
    linear = {cap: v for cap, v in lines.items() if cap.startswith("linear[")}
    assert "linear[q8_0]" in linear
    for cap, (kernel, reason) in linear.items():
        assert kernel.startswith("zllm.domain."), (cap, kernel)
        assert "forced" in reason and "backend.force_reference" in reason, (cap, reason)
    for cap, (kernel, reason) in lines.items():
        if not cap.startswith("linear["):
            assert kernel.startswith("zllm_backend_cpu."), (cap, kernel)
            assert "forced" not in reason, (cap, reason)


def test_force_reference_of_an_op_the_model_lacks_names_the_key_and_the_ops(tmp_path):
    cfg = write_config(tmp_path, HF_DIR, backend={"force_reference": ["nonsense"]})
    line = one_line_error(zllm("run", "--config", cfg))
    assert line.startswith("error: backend.force_reference:")
    assert "nonsense" in line
    for op in ("attention", "embedding", "linear", "rms_norm"):
        assert op in line
