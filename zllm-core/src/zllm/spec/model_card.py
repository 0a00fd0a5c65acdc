"""ModelCard: what was loaded and from where — family, architecture, size, license, file hashes.

Pure data: no torch, no file reading (``zllm.weights.build_model_card`` gathers the values).
"""

from __future__ import annotations

import io

import attrs
from ruamel.yaml import YAML

CHECKPOINT_FORMATS = ("hf", "gguf")


@attrs.frozen
class CardFile:
    """One checkpoint file: ``path`` relative to the checkpoint's directory, size in bytes, sha256 hex."""

    path: str
    bytes: int
    sha256: str


@attrs.frozen
class ModelCard:
    """A description of one loaded checkpoint.

    Attributes:
        family: the model family that runs it (e.g. ``llama``).
        architecture: the checkpoint's own architecture name (HF ``model_type`` or GGUF
            ``general.architecture``).
        parameter_count: number of weights (logical elements, summed over all tensors).
        source: the checkpoint path as given.
        format: ``hf`` (safetensors directory) or ``gguf`` (single file).
        license: SPDX-like license id (``MIT``, ``Apache-2.0`` …), the first line of an
            unrecognised license file, or ``unknown``.
        files: every checkpoint file with its size and sha256.
    """

    family: str
    architecture: str
    parameter_count: int
    source: str
    format: str = attrs.field(validator=attrs.validators.in_(CHECKPOINT_FORMATS))
    license: str
    files: tuple[CardFile, ...] = attrs.field(converter=tuple[CardFile, ...])

    def to_yaml(self) -> str:
        """The card as a YAML mapping, keys in attribute order; ``files`` is a list of mappings."""
        yaml = YAML(typ="safe", pure=True)
        yaml.default_flow_style = False
        yaml.sort_base_mapping_type_on_output = False  # type: ignore[assignment]  # annotated None in ruamel
        out = io.StringIO()
        data = attrs.asdict(self, recurse=True)
        data["files"] = list(data["files"])  # a YAML sequence, never a tagged tuple
        yaml.dump(data, out)
        return out.getvalue()
