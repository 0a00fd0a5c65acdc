"""What every quantization method's planner shares: the plan (:class:`Fold`, :class:`QuantPlan`),
the context a planner works in, error helpers and the packing helpers of integer formats."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from zllm.spec.errors import CheckpointError, TensorError
from zllm.weights.formats import FORMATS, QuantizedTensor

Reader = Callable[[str], torch.Tensor]  # checkpoint tensor name -> the tensor (file-mapped)

ACTIVATION_SCALE_REASON = ("static activation scale: zllm's quantized kernels take f32 activations "
                           "(the dequantized-weight semantics), so it is not used")
# Said once per checkpoint whose config quantizes activations (W8A8, FP8 W8A8, NVFP4 W4A4): zllm
# runs such a checkpoint weight-only, which differs numerically from the integer / FP8 matmul
# its producer calibrated for.
ACTIVATIONS_NOTE = ("activations kept in f32, not quantized to {what} as the checkpoint's config says: its weights "
                    "run weight-only (dequantized-weight semantics, not the quantized-activation matmul)")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
FLOAT_SCALE_DTYPES = ("F32", "F16", "BF16")
E8M0_DTYPES = ("U8", "F8_E8M0")
# The fields of compressed-tensors' QuantizationArgs (a config group's weights and activations,
# a kv_cache_scheme).
CT_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype")


class Stored(Protocol):
    """What the checkpoint knows of one stored tensor from its safetensors header."""

    @property
    def file(self) -> Path:
        """The safetensors file holding the tensor."""
        ...

    @property
    def dtype(self) -> str:
        """Its safetensors dtype name (``F8_E4M3``, ``I32`` …)."""
        ...

    @property
    def shape(self) -> tuple[int, ...]:
        """Its stored shape."""
        ...


@attrs.frozen
class Fold:
    """One logical quantized weight and how to build it.

    Attributes:
        name: its logical (canonical) name, ``X.weight`` or gpt-oss's ``X``.
        fmt: its :data:`~zllm.weights.formats.FORMATS` name.
        shape: its logical shape ``(*L, N, K)``.
        block: the block one scale covers, for formats whose weights choose it.
        sources: the checkpoint tensors folded into it; the first stands in its place in
            the checkpoint's tensor order.
        build: ``build(read) -> QuantizedTensor``; reads the sources and raises
            :class:`TensorError` on bad values (NaN or infinite scales, a ``weight_shape`` that disagrees).
    """

    name: str
    fmt: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None
    sources: tuple[str, ...]
    build: Callable[[Reader], QuantizedTensor]

    @property
    def nbytes(self) -> int:
        """Bytes of the folded weight's parts (an act-order ``perm`` not counted)."""
        return FORMATS[self.fmt].nbytes(self.shape, self.block)


@attrs.frozen
class QuantPlan:
    """The folds of one checkpoint.

    Attributes:
        method: ``quantization_config.quant_method``.
        folds: logical name -> :class:`Fold`.
        skipped: checkpoint tensors nobody reads -> why (static activation scales).
        notes: lines for ``--explain`` on how zllm runs the checkpoint differently from what its
            config describes (activations the config quantizes are kept in f32).
        kv_cache: the FP8 KV cache the config declares (``"kv_cache_quant_algo: FP8"``), whose
            scales zllm skips (:mod:`zllm.weights.hf_quant.kv_cache`); None when it declares none.
    """

    method: str
    folds: dict[str, Fold]
    skipped: dict[str, str]
    notes: tuple[str, ...] = ()
    kv_cache: str | None = None

    @property
    def consumed(self) -> dict[str, str]:
        """Checkpoint tensor -> the logical weight it is folded into."""
        return {src: f.name for f in self.folds.values() for src in f.sources}


class PlanContext:
    """What a method's planner works with: the headers, a reader, and where errors point."""

    def __init__(self, config_file: Path, qconfig: Mapping[str, Any], entries: Mapping[str, Stored], read: Reader):
        self.config_file, self.qconfig, self.entries, self.read = config_file, qconfig, entries, read
        self.folds: dict[str, Fold] = {}
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []
        self.kv_cache: str | None = None

    def config_error(self, message: str) -> CheckpointError:
        """An error in the quantization config, naming its file."""
        return CheckpointError(str(self.config_file), f"quantization_config: {message}")

    def error(self, name: str, message: str) -> TensorError:
        """An error about checkpoint tensor ``name``, naming the file that holds it."""
        entry = self.entries.get(name)
        return TensorError(str(entry.file if entry is not None else self.config_file), name, message)

    def need(self, name: str, of: str, what: str) -> Stored:
        """Tensor ``name``, part of ``of``; a TensorError on ``of`` when it is missing."""
        entry = self.entries.get(name)
        if entry is None:
            raise self.error(of, f"{what} {name!r} is missing")
        return entry

    def expect(self, name: str, dtypes: Iterable[str], shape: tuple[int, ...] | None, what: str) -> Stored:
        """Tensor ``name`` (present), checked to be stored in one of ``dtypes`` with ``shape``
        (None: any); a TensorError naming it, the stored value and the expected one otherwise."""
        entry = self.entries[name]
        dtypes = tuple(dtypes)
        if entry.dtype not in dtypes:
            raise self.error(name, f"{what} stored as {entry.dtype}; expected {' or '.join(dtypes)}")
        if shape is not None and entry.shape != shape:
            raise self.error(name, f"{what} has shape {list(entry.shape)}; expected {list(shape)}")
        return entry

    def skip_activation_scales(self, prefix: str, names: Iterable[str]) -> None:
        """Mark the static activation scales ``prefix + name`` present as skipped (with the reason)."""
        for n in names:
            if prefix + n in self.entries:
                self.skipped[prefix + n] = ACTIVATION_SCALE_REASON

    def note_quantized_activations(self, what: str) -> None:
        """Say (once per ``what``) that the activations the config quantizes to ``what`` (``"int8
        per token (dynamic)"``) are kept in f32: a line of ``--explain``."""
        note = ACTIVATIONS_NOTE.format(what=what)
        if note not in self.notes:
            self.notes.append(note)

    def add(self, fold: Fold) -> None:
        """Record one logical weight's fold."""
        self.folds[fold.name] = fold


def check_keys(ctx: PlanContext, where: str, given: Mapping[str, Any], known: Iterable[str]) -> None:
    """A config error naming the fields of ``given`` (at ``where``) not in ``known``, listing those;
    one saying so when ``given`` is not an object (a string's letters were read as its fields)."""
    if not isinstance(given, Mapping):
        raise ctx.config_error(f"{where} must be an object, got {type(given).__name__} {given!r}")
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ctx.config_error(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                               f"in {where}; known: {', '.join(sorted(known))}")


def flag(ctx: PlanContext, where: str, given: Mapping[str, Any], key: str, default: bool) -> bool:
    """``given[key]`` (the config's ``{where}{key}``), ``default`` when absent or null; a config
    error unless it is true or false (``bool("false")`` is True)."""
    value = given.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ctx.config_error(f"{where}{key} {value!r} is not true or false")
    return value


def positive_int(value: Any) -> bool:
    """Whether a config value is an integer >= 1 (a bool is not, though Python counts it one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def block_shape(ctx: PlanContext, where: str, value: Any) -> tuple[int, int]:
    """The config's ``where`` as a block ``(rows, cols)``; a config error unless it is a list of
    two positive integers."""
    if not (isinstance(value, list) and len(value) == 2 and all(positive_int(v) for v in value)):
        raise ctx.config_error(f"{where} must be [rows, cols], two positive integers, got {value!r}")
    return value[0], value[1]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return -(-a // b)


def finite_scale(ctx: PlanContext, name: str, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` itself; a TensorError on ``name`` giving the first NaN's (else the first
    infinity's) index and the count if any: either decodes its whole group to NaN or inf."""
    for bad, what in ((torch.isnan(scale), "NaN"), (torch.isinf(scale), "infinite")):
        if bad.any():
            first = [int(i) for i in torch.nonzero(bad)[0]]
            raise ctx.error(name, f"{what} scale at index {first} ({int(bad.sum())} {what} of {scale.numel()})")
    return scale


def scale_f32(ctx: PlanContext, name: str, t: torch.Tensor, e8m0: bool) -> torch.Tensor:
    """A stored scale as f32: float dtypes as they are, E8M0 bytes ``b`` as ``2^(b - 127)``."""
    if e8m0:
        b = t.view(torch.uint8)
        if (b == 255).any():
            raise ctx.error(name, "E8M0 scale byte 255 (NaN)")
        return torch.ldexp(torch.ones(b.shape), b.to(torch.int32) - 127)
    return finite_scale(ctx, name, t.float())


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., W]`` packed little-endian, value ``i`` at bits ``bits * i`` -> uint8
    ``[..., W * 32 / bits]`` (4 or 8 bits)."""
    # [..., 4W]: little-endian bytes (through 1-D: a size-1 dimension can keep odd strides)
    data = words.reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], -1)
    if bits == 8:
        return data
    return torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values ``[..., K]`` (< 16) -> ``[..., K/2]``, low nibble = even column."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def kernel_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values uint8 ``[N, K]`` -> the ``int{bits}_g`` ``qweight``."""
    return pack_nibbles(q) if bits == 4 else q.contiguous()


def group_perm(ctx: PlanContext, name: str, g_idx: torch.Tensor, k: int, g: int) -> torch.Tensor | None:
    """The act-order permutation of a ``g_idx`` ``[K]`` (None when it is the identity grouping
    ``k // g``): stored column ``j`` is logical column ``perm[j]``, columns in group order."""
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise ctx.error(name, f"g_idx has shape {list(g_idx.shape)}; expected [{k}]")
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= k // g:
        raise ctx.error(name, f"g_idx values must lie in [0, {k // g}); found {int(g_idx.min())}..{int(g_idx.max())}")
    grouped = torch.arange(k) // g
    if torch.equal(g_idx, grouped):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], grouped):
        raise ctx.error(name, f"g_idx does not give every group {g} columns")
    return perm


def int_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, g: int,
                perm: torch.Tensor | None) -> QuantizedTensor:
    """An ``int{bits}_g`` weight from unsigned values ``[N, K]`` (logical column order),
    f32 scales and uint8 zeros ``[N, K/g]``; an act-order ``perm`` reorders the columns."""
    n, k = q.shape
    parts = {"scales": scales.contiguous(), "zeros": zeros.contiguous()}
    if perm is not None:
        q = q[:, perm]
        parts["perm"] = perm
    return QuantizedTensor({"qweight": kernel_qweight(q, bits), **parts}, f"int{bits}_g", (n, k), block=(1, g))
