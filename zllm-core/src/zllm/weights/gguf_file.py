"""GGUF checkpoints: one file read with :mod:`zllm.weights.gguf_header`, presented under HF names.

The reader memory-maps the file copy-on-write (``mode="c"``): tensor arrays are writable
views of the mapping, so ``torch.from_numpy`` shares them without a copy or a read-only
warning, and nothing written to a tensor reaches the file. Config, tensor names and the
Q/K RoPE layout come from the declarative map of the file's architecture
(:class:`~zllm.weights.gguf_maps.GGUFArchMap`), which the model families provide.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from zllm.spec.errors import CheckpointError, TensorError, UnknownArchitectureError
from zllm.weights.checkpoint import Checkpoint
from zllm.weights.formats import BLOCK_LAYOUTS, QuantizedTensor
from zllm.weights.gguf_header import GGUFFormatError, GGUFPartialBlockError, GGUFTensorInfo, read_gguf_header
from zllm.weights.gguf_maps import (
    REQUIRED,
    ROPE_ADJACENT_PAIR,
    ROPE_FREQS_TENSOR,
    GGUFArchMap,
    call_default,
    rope_scaling_config,
)

# GGML tensor type → zllm format. Other types are reported by name and refused by tensor().
# The block formats are the registry's GGUF layouts, named as gguf-py's enum names them.
GGUF_FORMATS: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "f32",
    GGMLQuantizationType.F16: "f16",
    GGMLQuantizationType.BF16: "bf16",
    **{GGMLQuantizationType[name.upper()]: name for name in BLOCK_LAYOUTS},
    GGMLQuantizationType.MXFP4: "mxfp4",  # repacked at load: see _mxfp4_from_gguf
}


def _mxfp4_from_gguf(data: torch.Tensor, shape: tuple[int, ...]) -> QuantizedTensor:
    """GGUF MXFP4 blocks -> the ``mxfp4`` kernel layout, once at load (no f32).

    ggml ``block_mxfp4`` (``ggml-common.h``): 17 bytes per 32 weights, an E8M0 exponent ``e``
    then ``qs[16]``, byte ``j`` holding weight ``j`` (low nibble) and weight ``j + 16`` (high
    nibble) as E2M1 codes; ``w = e2m1 * 2^(e - 127)`` (gguf-py's doubled values times
    ``2^(e - 128)``). The kernel layout keeps the exponents apart and pairs columns
    ``(2j, 2j + 1)`` in a byte.
    """
    *lead, rows, cols = shape
    blocks = data.reshape(*lead, rows, cols // 32, 17)  # [*lead, rows, K/32, 17]
    qs = blocks[..., 1:]  # [*lead, rows, K/32, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [*lead, rows, K/32, 32]: weight order
    qweight = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(*lead, rows, cols // 2)
    return QuantizedTensor({"qweight": qweight, "scales": blocks[..., 0].contiguous()}, "mxfp4", shape)


_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")
_HF_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _f32_value(value: float) -> float:
    # GGUF stores 1e-5 as float32 (9.99999974e-06); its shortest float32 repr is the value
    # that was written, so the config reads 1e-05 as config.json does.
    return float(str(np.float32(value)))


class GGUFCheckpoint(Checkpoint):
    """A GGUF file. See :func:`zllm.weights.open_checkpoint` for the errors at open.

    ``config`` and ``tensor_names`` need a map for the file's architecture among
    ``arch_maps`` (the installed families' maps, ``PluginHost.gguf_maps``); ``metadata``,
    ``files`` and ``load_tokenizer`` work for any architecture (vocabulary-only files
    included).
    """

    format = "gguf"

    def __init__(self, path: Path, arch_maps: Mapping[str, GGUFArchMap]):
        self.path = path
        self._arch_maps = dict(arch_maps)
        try:
            header = read_gguf_header(path)
        except GGUFPartialBlockError as e:
            raise TensorError(str(path), e.tensor, str(e)) from e
        except GGUFFormatError as e:  # says what is wrong (truncated, corrupt, big-endian …) and where
            raise CheckpointError(str(path), str(e)) from e
        except OSError as e:
            raise CheckpointError(str(path), f"cannot read GGUF file: {e}") from e
        self._fields = header.fields
        self._raw: dict[str, GGUFTensorInfo] = {t.name: t for t in header.tensors}

    # --- metadata -----------------------------------------------------------------------

    def _value(self, key: str) -> Any:
        """Decoded value of metadata ``key`` (float32 scalars as their shortest decimal); None if absent."""
        field = self._fields.get(key)
        if field is None:
            return None
        value = field.value
        if field.types[-1] == GGUFValueType.FLOAT32:
            value = [_f32_value(v) for v in value] if isinstance(value, list) else _f32_value(value)
        return value

    @functools.cached_property
    def metadata(self) -> dict[str, Any]:
        # As GGUFReader's fields without its GGUF.* pseudo-keys (version, counts); lists copied.
        return {
            k: list(f.value) if isinstance(f.value, list) else f.value
            for k, f in self._fields.items()
            if not k.startswith("GGUF.")
        }

    @property
    def files(self) -> list[Path]:
        return [self.path]

    @property
    def architecture(self) -> str:
        arch = self._value("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(str(self.path), "no 'general.architecture' metadata key")
        return arch

    @functools.cached_property
    def _map(self) -> GGUFArchMap:
        arch = self.architecture
        try:
            return self._arch_maps[arch]
        except KeyError:
            mapped = ", ".join(sorted(self._arch_maps)) or "none (no installed model family maps a GGUF architecture)"
            raise UnknownArchitectureError(
                str(self.path), f"no GGUF map for architecture {arch!r}; mapped architectures: {mapped}"
            ) from None

    def _scalar(self, key: str) -> Any:
        # llama.cpp's get_key_or_arr accepts per-layer arrays; zllm's config holds one value.
        value = self._value(key)
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise CheckpointError(str(self.path), f"metadata {key!r} varies per layer ({value}); not supported")
            value = value[0]
        return value

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """HF-style config built from ``{arch}.*`` keys by the architecture's map.

        Raises:
            UnknownArchitectureError: no map for the file's architecture.
            CheckpointError: a key llama.cpp requires is absent, or an unmapped RoPE scaling is set.
        """
        arch, m = self.architecture, self._map
        config: dict[str, Any] = {"model_type": m.model_type, **m.constants}
        for key in m.keys:
            full = f"{arch}.{key.gguf_key}"
            value = self._scalar(full)
            if value is None:
                if key.default is REQUIRED:
                    raise CheckpointError(
                        str(self.path), f"missing required metadata key {full!r} (for config {key.hf_key!r})"
                    )
                value = call_default(key.default, config)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                # The defaults divide by these and count layers with them.
                raise CheckpointError(str(self.path), f"metadata {full!r} is {value!r}; expected a number > 0")
            config[key.hf_key] = value
        try:
            scaling = rope_scaling_config(self._value, arch)
        except ValueError as e:
            raise CheckpointError(str(self.path), str(e)) from None
        if scaling is not None:
            config["rope_scaling"] = scaling
        freqs = self._raw.get(ROPE_FREQS_TENSOR)
        if freqs is not None:
            if freqs.tensor_type != GGMLQuantizationType.F32:
                raise TensorError(
                    str(self.path), ROPE_FREQS_TENSOR, f"stored as {freqs.tensor_type.name}; llama.cpp expects F32"
                )
            config["rope_freq_factors"] = [float(f) for f in np.asarray(freqs.data).reshape(-1)]
        # llama.cpp sizes token_embd by the vocabulary (tokenizer.ggml.tokens); files without
        # one (e.g. converted without a vocab) fall back to {arch}.vocab_size, then the rows.
        tokens = self._fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(tokens.value) if isinstance(tokens.value, list) else 1
        elif self._value(f"{arch}.vocab_size") is not None:
            config["vocab_size"] = self._value(f"{arch}.vocab_size")
        elif "token_embd.weight" in self._raw:
            config["vocab_size"] = int(self._raw["token_embd.weight"].shape[-1])
        config["tie_word_embeddings"] = "output.weight" not in self._raw
        if m.rope_layout == ROPE_ADJACENT_PAIR:
            config["rope_interleaved"] = True  # Q/K rows as stored: see gguf_maps.ROPE_ADJACENT_PAIR
        for flag, base in m.bias_flags.items():
            config[flag] = any(f"blk.{i}.{base}.bias" in self._raw for i in range(config["num_hidden_layers"]))
        config.update(self._special_ids())
        if m.finish_config is not None:
            try:
                config = m.finish_config(config, self._value, frozenset(self._raw))
            except ValueError as e:
                raise CheckpointError(str(self.path), str(e)) from None
        return config

    def _special_ids(self) -> dict[str, int]:
        ids = {}
        for hf_key, gguf_key in (
            ("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")
        ):
            value = self._value(gguf_key)
            if value is not None:
                ids[hf_key] = int(value)
        return ids

    @property
    def generation_config(self) -> dict[str, Any]:
        """``bos_token_id``/``eos_token_id`` from ``tokenizer.ggml.*`` (those present)."""
        return self._special_ids()

    # --- tensors ------------------------------------------------------------------------

    @functools.cached_property
    def _canonical(self) -> dict[str, GGUFTensorInfo]:
        """HF name → GGUF tensor."""
        m, out = self._map, {}
        for t in self._raw.values():
            if t.name == ROPE_FREQS_TENSOR:
                continue  # read into config["rope_freq_factors"], not a weight
            name = base = None
            if block := _BLOCK_TENSOR.fullmatch(t.name):
                layer, base, kind = block.groups()
                if f"{base}.{kind}" in m.block_tensors:
                    name = f"model.layers.{layer}.{m.block_tensors[f'{base}.{kind}']}"
                elif base in m.block_tensors:
                    name = f"model.layers.{layer}.{m.block_tensors[base]}.{kind}"
            elif glob := _GLOBAL_TENSOR.fullmatch(t.name):
                base, kind = glob.groups()
                if base in m.global_tensors:
                    name = f"{m.global_tensors[base]}.{kind}"
            if name is None:
                known = ", ".join([*m.global_tensors, *(f"blk.N.{b}" for b in m.block_tensors)])
                raise TensorError(
                    str(self.path), t.name,
                    f"no HF name in the {self.architecture!r} tensor map (mapped: {known}; .weight/.bias)",
                )
            out[name] = t
        return out

    def _lookup(self, name: str) -> GGUFTensorInfo:
        try:
            return self._canonical[name]
        except KeyError:
            raise TensorError(str(self.path), name, "not in the checkpoint") from None

    def tensor_names(self) -> list[str]:
        return list(self._canonical)

    def file_of(self, name: str) -> Path:
        self._lookup(name)
        return self.path

    def file_tensor_name(self, name: str) -> str:
        """The GGUF name of tensor ``name``: the file's, or for a tensor the file lacks the one
        the architecture's tensor map gives it (``name`` itself if the map has none)."""
        if name in self._canonical:
            return self._canonical[name].name
        m = self._map
        kind = name.rsplit(".", 1)[-1]
        if layer := _HF_LAYER_TENSOR.fullmatch(name):
            index, rest = layer.groups()
            for base, hf in m.block_tensors.items():
                if rest == hf or rest in (f"{hf}.weight", f"{hf}.bias"):
                    return f"blk.{index}.{base}" if rest == hf else f"blk.{index}.{base}.{kind}"
        for base, hf in m.global_tensors.items():
            if name in (f"{hf}.weight", f"{hf}.bias"):
                return f"{base}.{kind}"
        return name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        t = self._lookup(name)
        return t.shape[::-1]  # GGUF lists ne0 (columns) first

    def tensor_shape_format(self, name: str) -> tuple[tuple[int, ...], str]:
        t = self._lookup(name)
        fmt = GGUF_FORMATS.get(t.tensor_type)
        if fmt is None:
            raise TensorError(
                str(self.path), name,
                f"stored as GGUF type {t.tensor_type.name} (GGUF tensor {t.name!r}); supported types: "
                f"{', '.join(k.name for k in GGUF_FORMATS)}",
            )  # fmt: skip
        return self.tensor_shape(name), fmt

    def tensor(self, name: str) -> torch.Tensor | QuantizedTensor:
        t = self._lookup(name)
        shape, fmt = self.tensor_shape_format(name)
        data = torch.from_numpy(t.data)  # shares the copy-on-write mapping
        weight: torch.Tensor | QuantizedTensor
        if fmt == "mxfp4":
            weight = _mxfp4_from_gguf(data, shape)
        elif fmt in BLOCK_LAYOUTS:
            if len(shape) < 2:
                raise TensorError(
                    str(self.path), name, f"{fmt} tensor of shape {list(shape)}; quantized weights have rows "
                    "(2-D, or N-D with leading dimensions such as experts)",
                )  # fmt: skip
            # data: uint8 [*lead, rows, bytes per row]; an expert stack [E, N, K] is one view of
            # the file, each expert's rows contiguous (ggml's ne2 is the outermost dimension).
            weight = QuantizedTensor(data, fmt, shape)
        else:
            if fmt == "bf16":
                data = data.view(torch.bfloat16)  # the reader gives BF16 as uint8 [..., 2 * cols]
            weight = data
            assert tuple(weight.shape) == shape, (name, tuple(weight.shape), shape)
        return weight

    def load_tokenizer(self) -> Any:
        if "tokenizer.ggml.model" not in self._fields:
            raise CheckpointError(str(self.path), "no tokenizer: the file has no 'tokenizer.ggml.model' metadata")
        from zllm.tokenizer import Tokenizer

        return Tokenizer.from_gguf_metadata(self.metadata, str(self.path))
