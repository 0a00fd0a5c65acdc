"""Fixtures for the spec-layer tests: a stand-in HF checkpoint directory and GGUF file.

The config contract only checks that ``model.path`` exists and whether it is a directory
or a file, so empty stand-ins are enough here; reading real weights is the weights
layer's business.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def make_checkpoints(root: Path) -> tuple[Path, Path]:
    """Create ``root/ckpt/`` (an HF-style directory) and ``root/model.gguf``; return both."""
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    gguf = root / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return ckpt, gguf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Module-scoped (hypothesis forbids function-scoped fixtures under @given)."""
    return make_checkpoints(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def ckpt_dir(checkpoints: tuple[Path, Path]) -> Path:
    return checkpoints[0]


@pytest.fixture(scope="module")
def gguf_file(checkpoints: tuple[Path, Path]) -> Path:
    return checkpoints[1]
