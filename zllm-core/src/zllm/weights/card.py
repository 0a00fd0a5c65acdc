"""build_model_card: hash the checkpoint's files and find its license."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

from ruamel.yaml import YAML

from zllm.spec.model_card import CardFile, ModelCard
from zllm.weights.checkpoint import Checkpoint
from zllm.weights.loading import parameter_count

_CHUNK_BYTES = 1 << 20

# The opening words of common license texts → SPDX id. A text that matches none is reported
# by its first line, so the card never claims a license the file does not state.
_LICENSE_HEADINGS: tuple[tuple[str, str], ...] = (
    (r"MIT License", "MIT"),
    (r"Apache License,?\s+Version 2\.0", "Apache-2.0"),
    (r"BSD 3-Clause License", "BSD-3-Clause"),
    (r"BSD 2-Clause License", "BSD-2-Clause"),
    (r"GNU GENERAL PUBLIC LICENSE\s+Version 3", "GPL-3.0"),
    (r"Creative Commons Attribution 4\.0", "CC-BY-4.0"),
)


def sha256_file(path: Path) -> str:
    """Hex sha256 of ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def license_from_text(text: str) -> str:
    """SPDX id for a license text, else its first non-blank line (``unknown`` if blank)."""
    head = text[:2000]
    for pattern, spdx in _LICENSE_HEADINGS:
        if re.search(pattern, head, re.IGNORECASE):
            return spdx
    return next((line.strip() for line in text.splitlines() if line.strip()), "unknown")


def _license_file(directory: Path) -> Path | None:
    candidates = sorted(p for p in directory.glob("LICENSE*") if p.is_file())
    return candidates[0] if candidates else None


def _readme_license(directory: Path) -> str | None:
    # HF model repositories state their license in README.md's YAML front matter.
    readme = directory / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(encoding="utf-8", errors="replace")
    match = re.match(r"---\n(.*?)\n---", text, re.DOTALL)
    if not match:
        return None
    try:
        front = YAML(typ="safe", pure=True).load(io.StringIO(match.group(1)))
    except Exception:  # a malformed card is not a checkpoint error; the license stays unknown
        return None
    value = front.get("license") if isinstance(front, dict) else None
    return str(value) if value else None


def checkpoint_license(checkpoint: Checkpoint) -> str:
    """The checkpoint's license, first found of:

    1. a ``LICENSE`` / ``LICENSE.*`` file in the weights' directory, then its parent
       (a model folder often holds ``hf/`` and ``gguf/`` beside one LICENSE);
    2. GGUF ``general.license``;
    3. HF ``config.json`` ``license`` or ``README.md`` front matter ``license``;
    4. ``"unknown"``.
    """
    weights_dir = checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent
    for directory in (weights_dir, weights_dir.parent):
        found = _license_file(directory)
        if found is not None:
            return license_from_text(found.read_text(encoding="utf-8", errors="replace"))
    gguf_license = checkpoint.metadata.get("general.license")
    if gguf_license:
        return str(gguf_license)
    if checkpoint.format == "hf":
        config_license = checkpoint.config.get("license") or _readme_license(weights_dir)
        if config_license:
            return str(config_license)
    return "unknown"


def build_model_card(checkpoint: Checkpoint, family: str) -> ModelCard:
    """A :class:`ModelCard` for ``checkpoint`` run by model family ``family``.

    Reads every checkpoint file once to hash it (streaming). File paths in the card are
    relative to the checkpoint's directory (the GGUF file's own directory).
    """
    base = checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent
    files = tuple(CardFile(str(p.relative_to(base)), p.stat().st_size, sha256_file(p)) for p in checkpoint.files)
    return ModelCard(
        family=family,
        architecture=checkpoint.architecture,
        parameter_count=parameter_count(checkpoint),
        source=str(checkpoint.path),
        format=checkpoint.format,
        license=checkpoint_license(checkpoint),
        files=files,
    )
