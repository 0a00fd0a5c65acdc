"""Schema migrations: 0 -> 1 keeps the user's comments and yields a config that loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from ruamel.yaml.comments import CommentedMap

from zllm.spec.config import SCHEMA_VERSION, config_from_dict, load_config
from zllm.spec.errors import ConfigError
from zllm.spec.migrations import load_yaml_text, migrate, migrate_file_text, migration

V0_FILE = """\
# Tiny demo model, schema 0.
# Second header line.
model:
  checkpoint: {path}   # weights live here
  dtype: f32
sampling:   # how to pick tokens
  temperature: 0.7  # a little warm
  top_p: 0.9
  top_k: 40
  max_tokens: 32    # keep it short
server:
  port: 9000  # not the default
"""


@pytest.fixture
def v0_text(ckpt_dir: Path) -> str:
    return V0_FILE.format(path=ckpt_dir)


def test_migrate_file_text_keeps_every_comment(v0_text: str) -> None:
    out = migrate_file_text(v0_text)
    comments = [line.split("#", 1)[1].strip() for line in v0_text.splitlines() if "#" in line]
    assert len(comments) == 7
    for comment in comments:
        assert f"# {comment}" in out, comment
    # The renamed keys carry their trailing comments along.
    assert "max_new_tokens: 32 # keep it short" in out
    assert "generation: # how to pick tokens" in out
    assert "# weights live here" in out.split("path:", 1)[1].splitlines()[0]
    assert out.splitlines()[:3] == ["# Tiny demo model, schema 0.", "# Second header line.", "schema_version: 1"]
    assert "sampling" not in out and "checkpoint" not in out and "max_tokens" not in out


def test_migrated_file_loads_with_the_old_values(tmp_path: Path, v0_text: str, ckpt_dir: Path) -> None:
    migrated = tmp_path / "migrated.yaml"
    migrated.write_text(migrate_file_text(v0_text))
    cfg = load_config(migrated)
    assert cfg.model.path == str(ckpt_dir) and cfg.model.dtype == "f32"
    g = cfg.generation
    assert (g.temperature, g.top_p, g.top_k, g.max_new_tokens) == (0.7, 0.9, 40, 32)
    assert cfg.server.port == 9000
    # Loading the old file directly migrates it in memory to the same config.
    old = tmp_path / "old.yaml"
    old.write_text(v0_text)
    assert load_config(old) == cfg


def test_migrate_reports_each_change(v0_text: str) -> None:
    data, changes = migrate(load_yaml_text(v0_text, "v0.yaml"))
    assert isinstance(data, CommentedMap) and data["schema_version"] == SCHEMA_VERSION
    assert changes == [
        "model.checkpoint renamed model.path",
        "sampling.max_tokens renamed generation.max_new_tokens",
        "section sampling: renamed generation:",
        "schema_version 0 -> 1",
    ]


def test_explicit_schema_version_0_is_updated_where_it_stands() -> None:
    out = migrate_file_text("model:\n  checkpoint: x\nschema_version: 0  # old\n")
    assert out == "model:\n  path: x\nschema_version: 1  # old\n"


def test_current_file_is_left_as_written() -> None:
    text = "# header\nschema_version: 1\nmodel:\n  path: ./m  # here\ngeneration:\n  stop: ['\\n']\n"
    assert migrate_file_text(text) == text
    assert migrate(load_yaml_text(text, "x"))[1] == []


def test_plain_dict_is_migrated_too(ckpt_dir: Path) -> None:
    data = {"model": {"checkpoint": str(ckpt_dir)}, "sampling": {"max_tokens": 5, "top_k": 3}}
    migrated, _ = migrate(data)
    assert list(migrated) == ["schema_version", "model", "generation"]
    assert migrated["generation"] == {"max_new_tokens": 5, "top_k": 3}
    assert config_from_dict({"model": {"checkpoint": str(ckpt_dir)}}).model.path == str(ckpt_dir)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("model: {checkpoint: a, path: b}\n", "model.checkpoint"),
        ("model: {path: a}\nsampling: {top_k: 1}\ngeneration: {top_p: 1}\n", "sampling"),
        ("model: {path: a}\nsampling: {temprature: 1}\n", "sampling.temprature"),
        ("schema_version: -1\nmodel: {path: a}\n", "schema_version"),
        ("schema_version: one\nmodel: {path: a}\n", "schema_version"),
    ],
)
def test_untranslatable_old_config_names_the_old_key(text: str, path: str) -> None:
    with pytest.raises(ConfigError) as exc:
        migrate_file_text(text)
    assert exc.value.path == path


def test_newer_schema_is_rejected_naming_both_numbers(tmp_path: Path) -> None:
    newer = SCHEMA_VERSION + 1
    with pytest.raises(ConfigError) as exc:
        migrate_file_text(f"schema_version: {newer}\nmodel: {{path: a}}\n")
    assert exc.value.path == "schema_version"
    assert str(exc.value) == (
        f"schema_version: the config has schema_version {newer}, but this zllm-core reads "
        f"schema_version {SCHEMA_VERSION} and older; upgrade zllm-core"
    )
    cfg_file = tmp_path / "new.yaml"
    cfg_file.write_text(f"schema_version: {newer}\nmodel: {{path: a}}\n")
    with pytest.raises(ConfigError, match=f"schema_version {newer}"):
        load_config(cfg_file)


def test_yaml_error_names_source_and_line() -> None:
    with pytest.raises(ConfigError, match=r"invalid YAML in my\.yaml line 2, column 4"):
        migrate_file_text("a: 1\n  b: 2\n", source="my.yaml")


def test_second_migration_for_a_version_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @migration(from_version=0)
        def _again(data):  # pragma: no cover - never registered, never run
            return []
