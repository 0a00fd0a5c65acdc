"""Shared fixtures: the repository root, the shipped model, configs built in tmp dirs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "assets" / "models" / "stories260k"
CONFIGS = REPO / "configs"
REFERENCE_TEXT = (MODEL_DIR / "reference_output.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def write_config(tmp_path: Path, model_path: Path | str, **sections) -> Path:
    """A config file in ``tmp_path`` for ``model_path`` with extra sections merged in."""
    from ruamel.yaml import YAML

    data = {"schema_version": 1, "model": {"path": str(model_path)}, "backend": {"name": "cpu"}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = tmp_path / "config.yaml"
    with path.open("w") as f:
        YAML().dump(data, f)
    return path


def copy_tokenizer(dst: Path) -> None:
    """Put the stories260K tokenizer files (vocab 512) into a checkpoint dir."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / "hf" / name, dst / name)
