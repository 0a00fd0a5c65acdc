"""Checkpoint: a read-only, layout-aware view of one model's weight files.

Two formats: an HF directory (``config.json`` + safetensors, see :mod:`zllm.weights.hf`) and a
single GGUF file (see :mod:`zllm.weights.gguf_file`). Both present tensors under canonical
(Hugging Face) names, in their stored dtype or block format, without copying file data.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zllm.spec.errors import CheckpointError, TensorError
from zllm.spec.tensor_spec import Shard
from zllm.weights.formats import BLOCK_LAYOUTS, DTYPE_OF_FORMAT, FORMATS, QuantizedTensor
from zllm.weights.gguf_maps import GGUFArchMap

CHECKPOINT_FORMATS = ("auto", "hf", "gguf")
GGUF_MAGIC = b"GGUF"


class Checkpoint(abc.ABC):
    """A model checkpoint, opened but not loaded. Tensor data is read (mapped) on demand.

    Attributes:
        path: the directory (``hf``) or file (``gguf``) that was opened.
        format: ``"hf"`` or ``"gguf"``.
    """

    path: Path
    format: str

    @property
    @abc.abstractmethod
    def files(self) -> list[Path]:
        """Every file this checkpoint is made of (config, generation config, tokenizer, weights), under :attr:`path`."""

    @property
    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """The HF-style model config (``config.json`` keys: ``hidden_size``, ``num_hidden_layers`` …)."""

    @property
    @abc.abstractmethod
    def generation_config(self) -> dict[str, Any]:
        """HF-style generation defaults (``bos_token_id``, ``eos_token_id`` int or list …); may be empty."""

    @property
    @abc.abstractmethod
    def architecture(self) -> str:
        """The checkpoint's architecture name: HF ``model_type`` or GGUF ``general.architecture``."""

    @property
    @abc.abstractmethod
    def metadata(self) -> dict[str, Any]:
        """GGUF key/values decoded to Python values; ``{}`` for HF checkpoints."""

    @abc.abstractmethod
    def tensor_names(self) -> list[str]:
        """Canonical (HF) names of every tensor in the checkpoint, in file order."""

    @property
    def quantization(self) -> str | None:
        """One line on how a quantized HF checkpoint's weights were folded (``gptq: 14 weights
        as int4_g``), for ``--explain``; None for other checkpoints."""
        return None

    @property
    def quantization_notes(self) -> tuple[str, ...]:
        """Lines for ``--explain`` on where zllm runs a quantized HF checkpoint differently from
        what its config describes (activations the config quantizes are kept in f32); empty
        for other checkpoints."""
        return ()

    @property
    def kv_cache_quantization(self) -> str | None:
        """The FP8 KV cache a quantized HF checkpoint's config declares (``"kv_cache_quant_algo:
        FP8"``), whose scales zllm does not apply: the cache stays in ``runtime.kv_cache.dtype``
        (:mod:`zllm.weights.hf_quant.kv_cache`). None when the checkpoint declares none."""
        return None

    @property
    def skipped_tensors(self) -> dict[str, str]:
        """Tensors the files hold that are no weights, left out of :meth:`tensor_names`:
        name -> why (for ``--explain``). Empty unless a format says otherwise."""
        return {}

    @abc.abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical shape of tensor ``name`` (a block-quantized tensor's dequantized
        ``(rows, cols)``), for any stored type, without reading data.

        Raises:
            TensorError: no tensor ``name`` in the checkpoint.
        """

    @abc.abstractmethod
    def tensor_shape_format(self, name: str) -> tuple[tuple[int, ...], str]:
        """Logical shape (as :meth:`tensor_shape`) and zllm format (``f32``, ``f16``, ``bf16``,
        or a :data:`~zllm.weights.formats.FORMATS` name: ``q8_0``, ``fp8_e4m3`` …) of tensor
        ``name``, without reading data.

        Raises:
            TensorError: no tensor ``name`` in the checkpoint, or it is stored in a type zllm
                does not support (the message names the stored type and the supported ones).
        """

    def tensor_nbytes(self, name: str) -> int:
        """Bytes tensor ``name`` occupies once loaded, in its stored format (every part of a
        quantized weight), without reading data.

        Raises:
            TensorError: as :meth:`tensor_shape_format`.
        """
        shape, fmt = self.tensor_shape_format(name)
        if fmt in FORMATS:
            return FORMATS[fmt].nbytes(shape)
        return math.prod(shape) * DTYPE_OF_FORMAT[fmt].itemsize

    @abc.abstractmethod
    def tensor(self, name: str) -> torch.Tensor | QuantizedTensor:
        """Tensor ``name`` in its stored dtype (dense) or block format (:class:`QuantizedTensor`).

        Dense and quantized tensors are backed by the file mapping (no copy); GGUF llama Q/K
        projections keep the file's adjacent-pair row order, which ``config["rope_interleaved"]``
        reports. Writing to a returned tensor never changes the file (mappings are copy-on-write).

        Raises:
            TensorError: as :meth:`tensor_shape_format`.
        """

    def tensor_slice(self, name: str, shard: Shard) -> torch.Tensor | QuantizedTensor:
        """The part ``shard`` of tensor ``name``, without reading the rest of it: a view of
        the file mapping (no copy) when the slice is contiguous in the file; a copy of the
        slice alone otherwise (a column slice, whose rows are strided).

        A quantized tensor is sliced along a row dimension freely, and along its columns only
        on whole blocks: each rank's columns must start and end on a block boundary.

        Raises:
            TensorError: as :meth:`tensor_shape_format`; or a column slice of a quantized
                tensor falls inside a block (names the tensor, its format, the block size and
                the columns per rank).
        """
        weight = self.tensor(name)
        if isinstance(weight, QuantizedTensor):
            if shard.start == 0 and shard.size == weight.shape[shard.dim]:
                return weight
            return _quantized_slice(weight, shard, name, str(self.file_of(name)))
        part = weight.narrow(shard.dim, shard.start, shard.size)
        return part if part.is_contiguous() else part.contiguous()

    @abc.abstractmethod
    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name`` (for error messages). Raises TensorError if absent."""

    def file_tensor_name(self, name: str) -> str:
        """The name the file itself gives tensor ``name``, or would give it if it lacks it (for
        error messages): the canonical name unless the format names tensors its own way
        (GGUF's ``blk.0.attn_q.weight``)."""
        return name

    @abc.abstractmethod
    def load_tokenizer(self) -> Any:
        """The checkpoint's tokenizer as a ``zllm.tokenizer.Tokenizer``.

        Raises:
            CheckpointError: the checkpoint carries no tokenizer.
        """


def check_block_shard(name: str, shape: tuple[int, ...], fmt: str, shard: Shard, file: str) -> None:
    """Refuse a shard of a block-quantized tensor whose columns fall inside a block, and any
    shard of a quantized HF checkpoint's weight (parts of several shapes; not sliced yet).

    Raises:
        TensorError: names the tensor, its format, the block size and the columns per rank; or
            names the tensor and its HF quantized format.
    """
    if shard.start == 0 and shard.size == shape[shard.dim]:
        return  # the whole tensor (one rank's padded vocabulary share): nothing is split
    if fmt in FORMATS and fmt not in BLOCK_LAYOUTS:
        raise TensorError(
            file, name, f"{fmt} weights (a quantized HF checkpoint's) cannot be split for tensor parallelism yet: "
            f"only dense and GGUF block-quantized weights are; use parallel.tensor: 1 (pipeline stages and "
            f"data-parallel replicas do take them)")
    if fmt not in BLOCK_LAYOUTS or shard.dim != len(shape) - 1:
        return
    block = BLOCK_LAYOUTS[fmt].block_size
    if shard.start % block or shard.size % block:
        raise TensorError(
            file, name, f"{fmt} blocks of {block} columns cannot be split for tensor parallelism: each rank would "
            f"hold {shard.size} of its {shape[-1]} columns, off a block boundary (zllm refuses rather than "
            f"replicates such a weight); use a parallel.tensor whose share is a multiple of {block} columns, or "
            f"a format with smaller blocks (q8_0: 32; f16)")


def _quantized_slice(weight: QuantizedTensor, shard: Shard, name: str, file: str) -> QuantizedTensor:
    """``shard`` of a block-quantized weight, as :meth:`Checkpoint.tensor_slice` describes."""
    check_block_shard(name, weight.shape, weight.fmt, shard, file)
    shape = list(weight.shape)
    last = len(shape) - 1
    if shard.dim < last:
        data = weight.data.narrow(shard.dim, shard.start, shard.size)
    else:
        block, type_size = weight.layout.block_size, weight.layout.type_size
        data = weight.data.narrow(last, shard.start // block * type_size, shard.size // block * type_size)
    shape[shard.dim] = shard.size
    return QuantizedTensor(data if data.is_contiguous() else data.contiguous(), weight.fmt, tuple(shape))


def open_checkpoint(
    path: str | Path, fmt: str = "auto", gguf_maps: Mapping[str, GGUFArchMap] | None = None
) -> Checkpoint:
    """Open the checkpoint at ``path``.

    Args:
        path: an HF checkpoint directory (``config.json`` + ``model.safetensors`` or
            ``model.safetensors.index.json`` and its shards) or a ``.gguf`` file.
        fmt: ``"auto"`` (a directory is ``hf``, a file is ``gguf``), ``"hf"`` or ``"gguf"``.
        gguf_maps: GGUF architecture -> map, through which a GGUF file's config and tensor
            names are read (the model families' maps: ``PluginHost.gguf_maps``). None maps
            no architecture: the file's metadata and tokenizer still read, its config
            raises :class:`~zllm.spec.errors.UnknownArchitectureError`.

    Returns:
        The opened :class:`Checkpoint`. Headers are parsed and file sizes checked against
        them here, so a truncated or corrupt file fails now, before any tensor is used.

    Raises:
        CheckpointError: ``path`` does not exist; ``fmt`` is unknown; a directory lacks
            ``config.json`` or weights; a file is not GGUF (bad magic); a file is truncated
            or its header is corrupt. The error names the offending file.
    """
    path = Path(path)
    if fmt not in CHECKPOINT_FORMATS:
        raise CheckpointError(
            str(path), f"unknown checkpoint format {fmt!r}; expected one of {', '.join(CHECKPOINT_FORMATS)}"
        )
    if not path.exists():
        raise CheckpointError(str(path), "no such file or directory")
    if fmt == "auto":
        fmt = "hf" if path.is_dir() else "gguf"
    if fmt == "hf":
        if not path.is_dir():
            raise CheckpointError(
                str(path), "an hf checkpoint is a directory holding config.json and model.safetensors"
            )
        from zllm.weights.hf import HFCheckpoint

        return HFCheckpoint(path)
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(str(path), f"a gguf checkpoint is a single .gguf file, and this is {kind}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            str(path),
            f"not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r}); "
            "an hf checkpoint is opened by its directory",
        )
    from zllm.weights.gguf_file import GGUFCheckpoint

    return GGUFCheckpoint(path, gguf_maps or {})
