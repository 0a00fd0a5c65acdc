"""HF checkpoints: a directory with ``config.json`` and safetensors weights (single or sharded).

Safetensors layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length ``N``, ``N`` bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data buffer; offsets are
relative to the buffer start ``8 + N``. The header is parsed here, at open time, to catch
truncated and corrupt files before any tensor is used; tensor data then comes from
``safetensors.safe_open(framework="pt")``, which (safetensors >= 0.4) maps the whole file
copy-on-write with ``torch.UntypedStorage.from_file(shared=False)`` and returns views of
that mapping — no second copy in RAM (``tests/weights`` checks the data pointers).

What transformers never loads is not presented as a tensor (:attr:`HFCheckpoint.skipped_tensors`
says what and why): ``*.rotary_emb.inv_freq`` buffers that older transformers versions saved,
and in a sharded checkpoint a tensor a shard holds that ``model.safetensors.index.json`` does
not map to that shard (the index decides, as in ``from_pretrained``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from zllm.spec.errors import CheckpointError, TensorError
from zllm.spec.tensor_spec import Shard
from zllm.weights.checkpoint import Checkpoint
from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant import Fold, QuantPlan, plan_quantization

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MODELOPT_CONFIG_FILE = "hf_quant_config.json"  # NVIDIA modelopt's exports before quantization_config

# safetensors dtype name → zllm format; other stored dtypes are rejected when used.
SAFETENSORS_FORMATS: dict[str, str] = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
# Element sizes, to check each tensor's byte span against its shape.
SAFETENSORS_ITEM_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


@attrs.frozen
class _Entry:
    """Where one tensor lives: ``file``, safetensors ``dtype`` name and ``shape``."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(file: Path) -> dict[str, _Entry]:
    """Parse and check the header of safetensors ``file``: tensor name → entry, in header order.

    Raises:
        CheckpointError: the file is shorter than its header promises (naming both byte
            counts) or the header is not valid safetensors JSON.
    """
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                str(file), f"truncated: {size} bytes, shorter than the 8-byte safetensors header length"
            )
        header_bytes = int.from_bytes(head, "little")
        if 8 + header_bytes > size:
            if f.read(1) not in (b"{", b""):
                # The header is JSON; without it this is no safetensors file at all, and
                # "truncated" (with an absurd promised size) would mislead.
                raise CheckpointError(
                    str(file), "not a safetensors file: no JSON header after the 8-byte header length"
                )
            raise CheckpointError(
                str(file), f"truncated: the header promises {8 + header_bytes} bytes, the file has {size} bytes"
            )
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(file), f"corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(str(file), "corrupt safetensors header: not a JSON object")
    entries: dict[str, _Entry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(str(file), f"corrupt safetensors header entry for {name!r}: {info!r} ({e})") from None
        numel = 1
        for d in shape:
            numel *= d
        item = SAFETENSORS_ITEM_BYTES.get(dtype)
        if not 0 <= begin <= end or (item is not None and end - begin != numel * item):
            raise CheckpointError(
                str(file),
                f"corrupt safetensors header: tensor {name!r} {dtype}{list(shape)} has data_offsets [{begin}, {end}]",
            )
        entries[name] = _Entry(file, dtype, shape)
        data_end = max(data_end, end)
    promised = 8 + header_bytes + data_end
    if promised > size:
        raise CheckpointError(str(file), f"truncated: the header promises {promised} bytes, the file has {size} bytes")
    return entries


#: Buffers older transformers versions saved with the weights (persistent then, recomputed
#: from the config at load by transformers and by zllm): skipped, with a line in ``--explain``.
NON_WEIGHT_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
NON_WEIGHT_BUFFER_REASON = "RoPE inverse frequencies saved by older transformers; recomputed from the config"


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(file), f"cannot read JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(str(file), f"expected a JSON object, got {type(value).__name__}")
    return value


class HFCheckpoint(Checkpoint):
    """An HF checkpoint directory. See :func:`zllm.weights.open_checkpoint` for the errors at open."""

    format = "hf"

    def __init__(self, path: Path):
        self.path = path
        config_file = path / CONFIG_FILE
        if not config_file.is_file():
            raise CheckpointError(
                str(path),
                f"not a checkpoint directory: no {CONFIG_FILE} (expected {CONFIG_FILE} plus {SINGLE_FILE} "
                f"or {INDEX_FILE} with its shards, or pass a .gguf file)",
            )
        self._config = _read_json(config_file)
        gen_file = path / GENERATION_CONFIG_FILE
        self._generation_config = _read_json(gen_file) if gen_file.is_file() else None

        self._index: Path | None = None
        self._skipped: dict[str, str] = {}
        if (path / SINGLE_FILE).is_file():
            shards = [path / SINGLE_FILE]
            self._entries = read_safetensors_header(shards[0])
        elif (path / INDEX_FILE).is_file():
            self._index = path / INDEX_FILE
            shards, self._entries = self._read_index(self._index)
        else:
            found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = (
                f"; found {', '.join(found)} (zllm reads safetensors; a .gguf file is opened by its own path)"
                if found else ""
            )
            raise CheckpointError(str(path), f"no weights: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")
        self._shards = shards
        self._skipped.update({name: NON_WEIGHT_BUFFER_REASON for name in self._entries
                              if NON_WEIGHT_BUFFER.search(name)})
        for name in self._skipped:
            self._entries.pop(name, None)
        # One copy-on-write mapping per shard, opened now so safetensors' own validation runs
        # at open time too.
        self._handles: dict[Path, Any] = {}
        for shard in shards:
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError and OSError
                raise CheckpointError(str(shard), f"cannot open safetensors file: {e}") from e
        self._quant: QuantPlan | None = None
        self._names = list(self._entries)
        qconfig_file, qconfig = config_file, self._config.get("quantization_config")
        if qconfig is None and (path / MODELOPT_CONFIG_FILE).is_file():
            qconfig_file = path / MODELOPT_CONFIG_FILE
            modelopt = _read_json(qconfig_file).get("quantization")
            if not isinstance(modelopt, dict):
                raise CheckpointError(str(qconfig_file), "no 'quantization' object")
            qconfig = {"quant_method": "modelopt", **modelopt}
        if qconfig is not None:
            self._quant = plan_quantization(qconfig_file, qconfig, self._entries, self._read)
            self._skipped.update(self._quant.skipped)
            consumed = self._quant.consumed
            self._names = [consumed.get(n, n) for n in self._entries if n not in self._quant.skipped
                           and (n not in consumed or self._quant.folds[consumed[n]].sources[0] == n)]

    def _read(self, name: str) -> torch.Tensor:
        """Stored tensor ``name`` as safetensors maps it (no dtype check)."""
        return self._handles[self._entries[name].file].get_tensor(name)

    def _fold(self, name: str) -> Fold | None:
        return None if self._quant is None else self._quant.folds.get(name)

    def _read_index(self, index: Path) -> tuple[list[Path], dict[str, _Entry]]:
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(str(index), "no 'weight_map' object (tensor name → shard file)")
        shards: list[Path] = []
        for shard_name in dict.fromkeys(weight_map.values()):
            shard = self.path / str(shard_name)
            if not shard.is_file():
                raise CheckpointError(str(shard), f"missing: shard named in {index.name} does not exist")
            shards.append(shard)
        headers = {shard: read_safetensors_header(shard) for shard in shards}
        entries: dict[str, _Entry] = {}
        for name, shard_name in weight_map.items():
            shard = self.path / str(shard_name)
            if name not in headers[shard]:
                raise TensorError(str(shard), name, f"listed in {index.name} but absent from the shard")
            entries[name] = headers[shard][name]
        # The index decides, as in transformers: a tensor a shard holds beside what the index
        # maps to it is never read.
        for shard, header in headers.items():
            for n in header:
                if n not in entries:
                    self._skipped[n] = f"in {shard.name} but not in {index.name}"
                elif entries[n].file != shard:
                    self._skipped.setdefault(
                        f"{n} ({shard.name})", f"{index.name} maps it to {entries[n].file.name}")
        return shards, entries

    @property
    def files(self) -> list[Path]:
        names = [CONFIG_FILE, GENERATION_CONFIG_FILE, MODELOPT_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
        files = [self.path / n for n in names if (self.path / n).is_file()]
        files += [f for _, f in self._chat_template_files()]
        if self._index is not None:
            files.append(self._index)
        return files + list(self._shards)

    @property
    def config(self) -> dict[str, Any]:
        return self._config

    @property
    def generation_config(self) -> dict[str, Any]:
        """``generation_config.json``; without one, ``bos_token_id``/``eos_token_id`` from the
        config, as transformers' ``GenerationConfig.from_model_config`` does."""
        if self._generation_config is not None:
            return self._generation_config
        return {k: self._config[k] for k in ("bos_token_id", "eos_token_id") if self._config.get(k) is not None}

    @property
    def architecture(self) -> str:
        model_type = self._config.get("model_type")
        if not isinstance(model_type, str):
            raise CheckpointError(str(self.path / CONFIG_FILE), "no 'model_type' string")
        return model_type

    @property
    def metadata(self) -> dict[str, Any]:
        return {}

    def _entry(self, name: str) -> _Entry:
        fold = self._fold(name)
        if fold is not None:
            return self._entries[fold.sources[0]]
        if self._quant is not None and name in self._quant.consumed:
            raise TensorError(str(self.path), name, f"folded into the quantized weight {self._quant.consumed[name]!r}")
        try:
            return self._entries[name]
        except KeyError:
            raise TensorError(str(self.path), name, "not in the checkpoint") from None

    def tensor_names(self) -> list[str]:
        """Canonical names in file order; a quantized weight's parts appear as its one logical
        name (:mod:`zllm.weights.hf_quant`), where its first part is."""
        return list(self._names)

    @property
    def quantization(self) -> str | None:
        if self._quant is None:
            return None
        counts: dict[str, int] = {}
        for fold in self._quant.folds.values():
            counts[fold.fmt] = counts.get(fold.fmt, 0) + 1
        kinds = ", ".join(f"{n} weight{'s' * (n != 1)} as {fmt}" for fmt, n in counts.items()) or "no quantized weights"
        return f"{self._quant.method}: {kinds}; the rest dense"

    @property
    def quantization_notes(self) -> tuple[str, ...]:
        return () if self._quant is None else self._quant.notes

    @property
    def kv_cache_quantization(self) -> str | None:
        return None if self._quant is None else self._quant.kv_cache

    @property
    def skipped_tensors(self) -> dict[str, str]:
        return dict(self._skipped)

    def file_of(self, name: str) -> Path:
        return self._entry(name).file

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        fold = self._fold(name)
        return fold.shape if fold is not None else self._entry(name).shape

    def tensor_nbytes(self, name: str) -> int:
        fold = self._fold(name)
        return fold.nbytes if fold is not None else super().tensor_nbytes(name)

    def tensor_shape_format(self, name: str) -> tuple[tuple[int, ...], str]:
        fold = self._fold(name)
        if fold is not None:
            return fold.shape, fold.fmt
        entry = self._entry(name)
        fmt = SAFETENSORS_FORMATS.get(entry.dtype)
        if fmt is None:
            hint = ("quantized weights need config.json's quantization_config" if self._quant is None
                    else f"quantization_config's quant_method {self._quant.method!r} does not quantize it so")
            raise TensorError(
                str(entry.file), name,
                f"stored as {entry.dtype}; supported safetensors dtypes: {', '.join(SAFETENSORS_FORMATS)} ({hint})",
            )
        return entry.shape, fmt

    def tensor(self, name: str) -> torch.Tensor | QuantizedTensor:
        fold = self._fold(name)
        if fold is not None:
            return fold.build(self._read)
        self.tensor_shape_format(name)  # refuses unsupported dtypes
        return self._read(name)

    def tensor_slice(self, name: str, shard: Shard) -> torch.Tensor | QuantizedTensor:
        if self._fold(name) is not None:  # the folded weight, not its first stored part
            return super().tensor_slice(name, shard)
        # safetensors' slice reads only the requested bytes of the mapping.
        shape, _ = self.tensor_shape_format(name)
        index = tuple(slice(shard.start, shard.start + shard.size) if d == shard.dim else slice(None)
                      for d in range(len(shape)))
        return self._handles[self._entry(name).file].get_slice(name)[index]

    def load_tokenizer(self) -> Any:
        from zllm.tokenizer import Tokenizer

        tokenizer_json = self.path / TOKENIZER_FILE
        if not tokenizer_json.is_file():
            raise CheckpointError(str(self.path), f"no tokenizer: expected {TOKENIZER_FILE}")
        tokenizer_config_file = self.path / TOKENIZER_CONFIG_FILE
        tokenizer_config = _read_json(tokenizer_config_file) if tokenizer_config_file.is_file() else None
        # Chat template files as transformers 5 saves them; they win over tokenizer_config's.
        templates: dict[str, str] = {}
        for name, file in self._chat_template_files():
            try:
                templates[name] = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(str(file), f"cannot read chat template: {exc}") from exc
        return Tokenizer.from_hf_files(tokenizer_json, tokenizer_config, self.generation_config or None, templates)

    def _chat_template_files(self) -> list[tuple[str, Path]]:
        """``(name, file)`` of the chat templates saved beside the tokenizer (transformers 5)."""
        extra = self.path / "additional_chat_templates"
        candidates = [("default", self.path / "chat_template.jinja"),
                      *((f.name.removesuffix(".jinja"), f) for f in sorted(extra.glob("*.jinja")))]
        return [(name, f) for name, f in candidates if f.is_file()]
