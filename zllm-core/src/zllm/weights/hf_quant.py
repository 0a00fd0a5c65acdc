"""Quantized HF checkpoints: ``config.json``'s ``quantization_config`` -> one logical weight per
quantized module, folded from its checkpoint tensors into a registry format's kernel layout.

A family's tensor specs name ``X.weight`` (``X`` a module prefix); a quantized checkpoint holds
``X.weight`` + ``X.weight_scale_inv``, or ``X.qweight`` + ``X.qzeros`` + ``X.scales`` +
``X.g_idx``, or ``X_blocks`` + ``X_scales`` …. :func:`plan_quantization` reads the safetensors
headers (and the tiny ``weight_shape`` tensors) once, at open time, and returns a
:class:`QuantPlan`: each logical weight with its format, logical shape and the checkpoint
tensors it consumes. The checkpoint then lists the logical names instead of the consumed ones,
so the family's specs are checked against logical shapes and every stray tensor still fails as
unused. A fold runs when its weight is loaded: it reads the parts (file mappings) and repacks
them once where the checkpoint's packing differs from the kernel layout — never into f32.

Methods and their checkpoint tensors (``N`` out-features, ``K`` in-features, ``g`` group):

- ``fp8`` (transformers ``FineGrainedFP8Config``; DeepSeek-V3, Qwen3-FP8): ``weight`` F8_E4M3
  ``[*L, N, K]`` with ``weight_scale_inv`` (or AutoFP8/vLLM's ``weight_scale``) F32
  ``[ceil(N/bn), ceil(K/bk)]`` for ``weight_block_size: [bn, bk]``, ``[N, 1]`` per channel or
  one value per tensor; U8/F8_E8M0 scale bytes ``b`` mean ``2^(b - 127)``.
- ``compressed-tensors`` (``format`` per config group or global): ``float-quantized`` (F8
  ``weight`` + ``weight_scale``, strategy tensor/channel/block/group); ``pack-quantized``
  (``weight_packed`` I32 ``[N, ceil(K*b/32)]`` as ``pack_to_int32``: value ``v + 2^(b-1)`` at
  bits ``b*i`` of the little-endian stream, ``weight_shape`` I64 ``[2]``, ``weight_scale``
  ``[N, K/g]``, ``weight_zero_point`` packed the same way along dim 0, optional
  ``weight_g_idx``); ``nvfp4-pack-quantized`` (``weight_packed`` U8 ``[N, K/2]``,
  ``weight_scale`` F8_E4M3 ``[N, K/16]``, ``weight_global_scale`` F32, whose reciprocal is the
  kernel's ``global_scale``); ``mxfp4-pack-quantized`` (``weight_packed`` U8, ``weight_scale``
  U8 E8M0 ``[N, K/32]``).
- ``gptq`` (AutoGPTQ/GPTQModel, ``checkpoint_format`` ``gptq`` or ``gptq_v2``): ``qweight`` I32
  ``[K*b/32, N]`` (packed along K: value ``i`` of a word at bits ``b*i``), ``qzeros`` I32
  ``[K/g, N*b/32]`` (packed along N; v1 stores ``z - 1``), ``scales`` ``[K/g, N]``, ``g_idx``
  I32 ``[K]`` (with ``desc_act`` a permutation into groups).
- ``awq`` (AutoAWQ ``version: gemm``): ``qweight`` I32 ``[K, N/8]`` packed along N in the
  interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i`` of a word holds column
  ``8c + order[i]``), ``qzeros`` I32 ``[K/g, N/8]`` alike, ``scales`` ``[K/g, N]``.
- ``mxfp4`` (gpt-oss): ``P_blocks`` U8 ``[*L, N, K/32, 16]`` and ``P_scales`` U8 (E8M0)
  ``[*L, N, K/32]`` -> the logical weight ``P`` of shape ``[*L, N, K]`` (rows = the blocks'
  rows, low nibble first).
- ``modelopt`` ``quant_algo: NVFP4``: ``weight`` U8 ``[N, K/2]``, ``weight_scale`` F8_E4M3
  ``[N, K/16]``, ``weight_scale_2`` F32 (the kernel's ``global_scale``).

Static activation scales (``input_scale``, ``activation_scale``, ``input_global_scale``) are
read by nobody: zllm's quantized kernels take f32 activations (the dequantized-weight
semantics), so they are skipped with that reason in ``--explain``. Modules a config leaves
unquantized (``ignore``, ``modules_to_not_convert``, ``exclude_modules``) simply hold dense
tensors and stay dense.
"""

from __future__ import annotations

import math
import re
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
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
_FLOAT_SCALE_DTYPES = ("F32", "F16", "BF16")
_E8M0_DTYPES = ("U8", "F8_E8M0")


class Stored(Protocol):
    """What the checkpoint knows of one stored tensor from its safetensors header."""

    @property
    def file(self) -> Path: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


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
            :class:`TensorError` on bad values (NaN scales, a ``weight_shape`` that disagrees).
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
    """

    method: str
    folds: dict[str, Fold]
    skipped: dict[str, str]

    @property
    def consumed(self) -> dict[str, str]:
        """Checkpoint tensor -> the logical weight it is folded into."""
        return {src: f.name for f in self.folds.values() for src in f.sources}


class _Ctx:
    """What a method's planner works with: the headers, a reader, and where errors point."""

    def __init__(self, config_file: Path, qconfig: Mapping[str, Any], entries: Mapping[str, Stored], read: Reader):
        self.config_file, self.qconfig, self.entries, self.read = config_file, qconfig, entries, read
        self.folds: dict[str, Fold] = {}
        self.skipped: dict[str, str] = {}

    def config_error(self, message: str) -> CheckpointError:
        return CheckpointError(str(self.config_file), f"quantization_config: {message}")

    def error(self, name: str, message: str) -> TensorError:
        entry = self.entries.get(name)
        return TensorError(str(entry.file if entry is not None else self.config_file), name, message)

    def need(self, name: str, of: str, what: str) -> Stored:
        """Tensor ``name``, part of ``of``; a TensorError on ``of`` when it is missing."""
        entry = self.entries.get(name)
        if entry is None:
            raise self.error(of, f"{what} {name!r} is missing")
        return entry

    def expect(self, name: str, dtypes: Iterable[str], shape: tuple[int, ...] | None, what: str) -> Stored:
        entry = self.entries[name]
        dtypes = tuple(dtypes)
        if entry.dtype not in dtypes:
            raise self.error(name, f"{what} stored as {entry.dtype}; expected {' or '.join(dtypes)}")
        if shape is not None and entry.shape != shape:
            raise self.error(name, f"{what} has shape {list(entry.shape)}; expected {list(shape)}")
        return entry

    def skip_activation_scales(self, prefix: str, names: Iterable[str]) -> None:
        for n in names:
            if prefix + n in self.entries:
                self.skipped[prefix + n] = ACTIVATION_SCALE_REASON

    def add(self, fold: Fold) -> None:
        self.folds[fold.name] = fold


def _check_keys(ctx: _Ctx, where: str, given: Mapping[str, Any], known: Iterable[str]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ctx.config_error(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                               f"in {where}; known: {', '.join(sorted(known))}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _no_nan(ctx: _Ctx, name: str, scale: torch.Tensor) -> torch.Tensor:
    if torch.isnan(scale).any():
        first = [int(i) for i in torch.nonzero(torch.isnan(scale))[0]]
        raise ctx.error(name, f"NaN scale at index {first} ({int(torch.isnan(scale).sum())} NaN of {scale.numel()})")
    return scale


def _scale_f32(ctx: _Ctx, name: str, t: torch.Tensor, e8m0: bool) -> torch.Tensor:
    """A stored scale as f32: float dtypes as they are, E8M0 bytes ``b`` as ``2^(b - 127)``."""
    if e8m0:
        b = t.view(torch.uint8)
        if (b == 255).any():
            raise ctx.error(name, "E8M0 scale byte 255 (NaN)")
        return torch.ldexp(torch.ones(b.shape), b.to(torch.int32) - 127)
    return _no_nan(ctx, name, t.float())


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., W]`` packed little-endian, value ``i`` at bits ``bits * i`` -> uint8
    ``[..., W * 32 / bits]`` (4 or 8 bits)."""
    # [..., 4W]: little-endian bytes (through 1-D: a size-1 dimension can keep odd strides)
    data = words.reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], -1)
    if bits == 8:
        return data
    return torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values ``[..., K]`` (< 16) -> ``[..., K/2]``, low nibble = even column."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def _kernel_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values uint8 ``[N, K]`` -> the ``int{bits}_g`` ``qweight``."""
    return _pack_nibbles(q) if bits == 4 else q.contiguous()


def _group_perm(ctx: _Ctx, name: str, g_idx: torch.Tensor, k: int, g: int) -> torch.Tensor | None:
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


def _int_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, g: int,
                perm: torch.Tensor | None) -> QuantizedTensor:
    """An ``int{bits}_g`` weight from unsigned values ``[N, K]`` (logical column order),
    f32 scales and uint8 zeros ``[N, K/g]``; an act-order ``perm`` reorders the columns."""
    n, k = q.shape
    parts = {"scales": scales.contiguous(), "zeros": zeros.contiguous()}
    if perm is not None:
        q = q[:, perm]
        parts["perm"] = perm
    return QuantizedTensor({"qweight": _kernel_qweight(q, bits), **parts}, f"int{bits}_g", (n, k), block=(1, g))


# ------------------------------------------------------------------------------ fp8

_FP8_KEYS = ("quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype")


def _fp8_block(ctx: _Ctx, scale_name: str, scale_shape: tuple[int, ...], shape: tuple[int, ...],
               blocks: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The ``(bn, bk)`` a stored scale's shape means for a weight ``(*L, N, K)``: per tensor,
    per channel (``[N, 1]`` or ``[N]``) or one of ``blocks``."""
    *lead, n, k = shape
    lead_t = tuple(lead)
    if math.prod(scale_shape) == math.prod(lead_t) and scale_shape[: len(lead_t)] == lead_t:
        return (n, k)
    if scale_shape in ((*lead_t, n, 1), (*lead_t, n)):
        return (1, k)
    for bn, bk in blocks:
        if scale_shape == (*lead_t, _ceil(n, bn), _ceil(k, bk)):
            return (bn, bk)
    wanted = [f"[{', '.join(map(str, (*lead_t, _ceil(n, bn), _ceil(k, bk))))}] for blocks ({bn}, {bk})"
              for bn, bk in blocks]
    per_channel = ", ".join(map(str, (*lead_t, n, 1)))
    blocks_text = f" nor {'; '.join(wanted)}" if wanted else ""
    raise ctx.error(scale_name, f"scale shape {list(scale_shape)} fits neither one scale per tensor nor per "
                    f"channel [{per_channel}]{blocks_text} of weight {list(shape)}")


def _fp8_fold(ctx: _Ctx, weight: str, scale: str, block: tuple[int, int], shape: tuple[int, ...],
              extra: tuple[str, ...] = ()) -> Fold:
    e8m0 = ctx.entries[scale].dtype in _E8M0_DTYPES
    *lead, n, k = shape
    scale_shape = (*lead, _ceil(n, block[0]), _ceil(k, block[1]))

    def build(read: Reader) -> QuantizedTensor:
        q = read(weight).view(torch.uint8)
        s = _scale_f32(ctx, scale, read(scale), e8m0).reshape(scale_shape).contiguous()
        return QuantizedTensor({"qweight": q, "scale": s}, "fp8_e4m3", shape, block=block)

    return Fold(weight, "fp8_e4m3", shape, block, (weight, scale, *extra), build)


def _plan_fp8(ctx: _Ctx) -> None:
    q = ctx.qconfig
    _check_keys(ctx, "quant_method 'fp8'", q, _FP8_KEYS)
    blocks: list[tuple[int, int]] = []
    if q.get("weight_block_size") is not None:
        wbs = q["weight_block_size"]
        if not (isinstance(wbs, list) and len(wbs) == 2 and all(isinstance(v, int) and v > 0 for v in wbs)):
            raise ctx.config_error(f"weight_block_size must be two positive integers [rows, cols], got {wbs!r}")
        blocks.append((wbs[0], wbs[1]))
    for name, entry in list(ctx.entries.items()):
        if entry.dtype != "F8_E4M3" or not name.endswith("weight"):
            continue
        prefix = name.removesuffix("weight")
        scales = [prefix + s for s in ("weight_scale_inv", "weight_scale") if prefix + s in ctx.entries]
        if not scales:
            raise ctx.error(name, f"FP8 weight with no scale: expected {prefix}weight_scale_inv "
                                  f"(or {prefix}weight_scale)")
        if len(scales) > 1:
            raise ctx.error(name, f"two scales for one FP8 weight: {scales[0]} and {scales[1]}")
        ctx.expect(scales[0], (*_FLOAT_SCALE_DTYPES, *_E8M0_DTYPES), None, "FP8 scale")
        if len(entry.shape) < 2:
            raise ctx.error(name, f"FP8 weight of shape {list(entry.shape)}; quantized weights have rows")
        block = _fp8_block(ctx, scales[0], ctx.entries[scales[0]].shape, entry.shape, blocks)
        ctx.add(_fp8_fold(ctx, name, scales[0], block, entry.shape))
        ctx.skip_activation_scales(prefix, ("activation_scale", "input_scale"))


# ------------------------------------------------------------------- compressed-tensors

_CT_KEYS = ("quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
            "global_compression_ratio", "sparsity_config", "moe_sparsity_config", "transform_config", "version",
            "provider")
_CT_GROUP_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
_CT_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                 "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype")
CT_FORMATS = ("float-quantized", "pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


@attrs.frozen
class _CtGroup:
    targets: tuple[str, ...]
    weights: Mapping[str, Any]
    format: str | None


def _ct_groups(ctx: _Ctx) -> list[_CtGroup]:
    q = ctx.qconfig
    _check_keys(ctx, "quant_method 'compressed-tensors'", q, _CT_KEYS)
    for key in ("sparsity_config", "moe_sparsity_config"):
        if q.get(key):
            raise ctx.config_error(f"{key} (sparse compressed-tensors checkpoints) is not supported")
    if q.get("kv_cache_scheme"):
        raise ctx.config_error("kv_cache_scheme (a quantized KV cache) is not supported")
    if q.get("transform_config"):
        raise ctx.config_error("transform_config (rotated weights) is not supported")
    groups = []
    for gname, group in (q.get("config_groups") or {}).items():
        _check_keys(ctx, f"config_groups.{gname}", group, _CT_GROUP_KEYS)
        weights = group.get("weights") or {}
        _check_keys(ctx, f"config_groups.{gname}.weights", weights, _CT_ARGS_KEYS)
        fmt = group.get("format") or q.get("format")
        if weights and fmt not in CT_FORMATS:
            raise ctx.config_error(f"format {fmt!r} (config_groups.{gname}) is not supported; supported: "
                                   f"{', '.join(CT_FORMATS)}")
        groups.append(_CtGroup(tuple(group.get("targets") or ()), weights, fmt))
    return groups


def _ct_group_of(ctx: _Ctx, groups: list[_CtGroup], module: str) -> _CtGroup:
    """The config group of ``module``: the first whose ``re:`` target matches its name, else the
    first with a class-name target (``Linear``: the loader knows no module classes, and only
    modules holding quantized tensors are asked)."""
    for g in groups:
        if any(t.startswith("re:") and re.match(t[3:], module) for t in g.targets):
            return g
    for g in groups:
        if any(not t.startswith("re:") for t in g.targets):
            return g
    raise ctx.error(module + ".weight", "quantized tensors, but no config group targets this module")


def _ct_args(group: _CtGroup) -> tuple[int, str, str, bool, int | None]:
    """``(num_bits, type, strategy, symmetric, group_size)`` of a config group's weights."""
    w = group.weights
    bits, kind = w.get("num_bits"), w.get("type")
    strategy, symmetric, group_size = w.get("strategy"), bool(w.get("symmetric", True)), w.get("group_size")
    return int(bits or 0), str(kind), str(strategy), symmetric, group_size


def _ct_float(ctx: _Ctx, prefix: str, group: _CtGroup) -> None:
    name, scale = prefix + "weight", prefix + "weight_scale"
    entry = ctx.entries[name]
    ctx.need(scale, name, "FP8 scale")
    ctx.expect(scale, _FLOAT_SCALE_DTYPES, None, "FP8 scale")
    bits, kind, strategy, _, group_size = _ct_args(group)
    if kind != "float" or bits != 8:
        raise ctx.config_error(f"float-quantized {kind} with {bits} bits is not supported (float with 8 bits is)")
    blocks: list[tuple[int, int]] = []
    if strategy == "block":
        bs = group.weights.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2):
            raise ctx.config_error(f"strategy 'block' needs block_structure [rows, cols], got {bs!r}")
        blocks.append((int(bs[0]), int(bs[1])))
    elif strategy == "group" and group_size:
        blocks.append((1, int(group_size)))
    block = _fp8_block(ctx, scale, ctx.entries[scale].shape, entry.shape, blocks)
    ctx.add(_fp8_fold(ctx, name, scale, block, entry.shape))
    ctx.skip_activation_scales(prefix, ("input_scale",))


def _ct_pack(ctx: _Ctx, prefix: str, group: _CtGroup) -> None:
    packed, logical = prefix + "weight_packed", prefix + "weight"
    bits, kind, strategy, symmetric, group_size = _ct_args(group)
    if kind != "int" or bits not in (4, 8):
        raise ctx.config_error(f"pack-quantized {kind} with {bits} bits is not supported (int with 4 or 8 bits is)")
    shape_name = prefix + "weight_shape"
    ctx.need(shape_name, packed, "the logical shape")
    ctx.expect(shape_name, ("I64", "I32"), (2,), "weight_shape")
    n, k = (int(v) for v in ctx.read(shape_name).tolist())
    ctx.expect(packed, ("I32",), None, "packed weight")
    if ctx.entries[packed].shape != (n, _ceil(k * bits, 32)):
        raise ctx.error(packed, f"packed shape {list(ctx.entries[packed].shape)} disagrees with weight_shape "
                                f"[{n}, {k}] at {bits} bits: expected [{n}, {_ceil(k * bits, 32)}]")
    g = int(group_size) if strategy == "group" and group_size else k
    if strategy not in ("group", "channel"):
        raise ctx.config_error(f"pack-quantized strategy {strategy!r} is not supported (group, channel are)")
    if k % g or (bits == 4 and k % 2):
        raise ctx.error(packed, f"group size {g} does not divide K = {k}" if k % g else f"odd K = {k} at 4 bits")
    scale = ctx.need(prefix + "weight_scale", packed, "scale")
    if scale.shape not in ((n, k // g),):
        raise ctx.error(prefix + "weight_scale", f"scale has shape {list(scale.shape)}; expected [{n}, {k // g}]")
    ctx.expect(prefix + "weight_scale", _FLOAT_SCALE_DTYPES, None, "scale")
    sources = [packed, prefix + "weight_scale", shape_name]
    zp_name = prefix + "weight_zero_point"
    if not symmetric:
        ctx.need(zp_name, packed, "zero point")
        ctx.expect(zp_name, ("I32",), (_ceil(n * bits, 32), k // g), "zero point")
        sources.append(zp_name)
    g_idx_name = prefix + "weight_g_idx"
    if g_idx_name in ctx.entries:
        ctx.expect(g_idx_name, ("I32", "I64"), (k,), "g_idx")
        sources.append(g_idx_name)
    offset = 1 << (bits - 1)

    def build(read: Reader) -> QuantizedTensor:
        q = _unpack_words(read(packed), bits)[:, :k]  # [N, K] unsigned: value + offset
        scales = _no_nan(ctx, prefix + "weight_scale", read(prefix + "weight_scale").float())
        if symmetric:
            zeros = torch.full((n, k // g), offset, dtype=torch.uint8)
        else:  # packed along N: words [ceil(N*b/32), K/g]
            zeros = _unpack_words(read(zp_name).t(), bits)[:, :n].t()  # [N, K/g] unsigned
        perm = _group_perm(ctx, g_idx_name, read(g_idx_name), k, g) if g_idx_name in ctx.entries else None
        return _int_weight(q, scales, zeros, bits, g, perm)

    ctx.add(Fold(logical, f"int{bits}_g", (n, k), (1, g), tuple(sources), build))
    ctx.skip_activation_scales(prefix, ("input_scale", "input_global_scale"))


def _ct_fp4(ctx: _Ctx, prefix: str, group: _CtGroup, fmt: str) -> None:
    packed, logical, scale = prefix + "weight_packed", prefix + "weight", prefix + "weight_scale"
    bits, kind, _, _, group_size = _ct_args(group)
    gs = 16 if fmt == "nvfp4" else 32
    if kind != "float" or bits != 4 or group_size != gs:
        raise ctx.config_error(f"{fmt}-pack-quantized needs float weights of 4 bits in groups of {gs}; "
                               f"config says {kind} with {bits} bits in groups of {group_size}")
    entry = ctx.expect(packed, ("U8",), None, "packed FP4 weight")
    *lead, n, half = entry.shape
    k = 2 * half
    ctx.need(scale, packed, "block scale")
    ctx.expect(scale, ("F8_E4M3",) if fmt == "nvfp4" else _E8M0_DTYPES, (*lead, n, k // gs), "block scale")
    if k % gs:
        raise ctx.error(packed, f"K = {k} is not a multiple of the {fmt} block of {gs}")
    sources = [packed, scale]
    glob = prefix + "weight_global_scale"
    if fmt == "nvfp4":
        ctx.need(glob, packed, "global scale")
        ctx.expect(glob, ("F32",), None, "global scale")
        sources.append(glob)
    shape = (*lead, n, k)

    def build(read: Reader) -> QuantizedTensor:
        parts = {"qweight": read(packed), "scales": read(scale).view(torch.uint8)}
        if fmt == "mxfp4" and (parts["scales"] == 255).any():
            raise ctx.error(scale, "E8M0 scale byte 255 (NaN)")
        if fmt == "nvfp4":
            _no_nan(ctx, scale, parts["scales"].view(torch.float8_e4m3fn).float())
            gscale = _no_nan(ctx, glob, read(glob).float()).reshape(tuple(lead))
            if (gscale == 0).any():
                raise ctx.error(glob, "weight_global_scale 0 has no reciprocal")
            parts["global_scale"] = 1.0 / gscale
        return QuantizedTensor(parts, fmt, shape)

    ctx.add(Fold(logical, fmt, shape, None, tuple(sources), build))
    ctx.skip_activation_scales(prefix, ("input_global_scale", "input_scale"))


def _plan_compressed_tensors(ctx: _Ctx) -> None:
    groups = _ct_groups(ctx)
    for name, entry in list(ctx.entries.items()):
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix("weight_packed")
            group = _ct_group_of(ctx, groups, prefix.rstrip("."))
            if group.format == "pack-quantized":
                _ct_pack(ctx, prefix, group)
            elif group.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
                _ct_fp4(ctx, prefix, group, group.format.split("-")[0])
            else:
                raise ctx.error(name, f"packed weight, but its config group's format is {group.format!r}")
        elif name.endswith(".weight") and entry.dtype == "F8_E4M3":
            prefix = name.removesuffix("weight")
            group = _ct_group_of(ctx, groups, prefix.rstrip("."))
            if group.format != "float-quantized":
                raise ctx.error(name, f"FP8 weight, but its config group's format is {group.format!r}")
            _ct_float(ctx, prefix, group)


# ------------------------------------------------------------------------ gptq / awq

_GPTQ_KEYS = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format",
              "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
              "model_file_base_name", "tokenizer", "dataset", "act_group_aware", "meta", "backend", "model_seqlen",
              "block_name_to_quantize", "module_name_preceding_first_block", "batch_size", "pad_token_id",
              "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize", "use_exllama",
              "exllama_config", "use_cuda_fp16", "pack_dtype", "lm_head", "mse", "v2", "hyb_act",
              "modules_to_not_convert")
_AWQ_KEYS = (*_GPTQ_KEYS, "zero_point", "version", "do_fuse", "fuse_max_seq_len", "modules_to_fuse")


def _bits_group(ctx: _Ctx, allowed_bits: tuple[int, ...]) -> tuple[int, int]:
    bits, group = ctx.qconfig.get("bits"), ctx.qconfig.get("group_size", 128)
    if bits not in allowed_bits:
        raise ctx.config_error(f"bits {bits!r} is not supported for {ctx.qconfig['quant_method']!r}; supported: "
                               f"{', '.join(map(str, allowed_bits))}")
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise ctx.config_error(f"group_size must be a positive integer or -1, got {group!r}")
    return bits, group


def _int_modules(ctx: _Ctx, what: str, k_of: Callable[[Stored], int], n_of: Callable[[Stored], int],
                 ) -> Iterable[tuple[str, int, int]]:
    """``(prefix, N, K)`` of each module with a ``qweight``."""
    for name, entry in list(ctx.entries.items()):
        if name.endswith(".qweight"):
            ctx.expect(name, ("I32",), None, f"{what} qweight")
            if len(entry.shape) != 2:
                raise ctx.error(name, f"{what} qweight of shape {list(entry.shape)}; expected 2-D")
            yield name.removesuffix("qweight"), n_of(entry), k_of(entry)


def _plan_gptq(ctx: _Ctx) -> None:
    q = ctx.qconfig
    _check_keys(ctx, "quant_method 'gptq'", q, _GPTQ_KEYS)
    bits, group = _bits_group(ctx, (4, 8))
    version = q.get("checkpoint_format") or q.get("format") or "gptq"
    if version not in ("gptq", "gptq_v2"):
        raise ctx.config_error(f"checkpoint_format {version!r} is not supported; supported: gptq, gptq_v2")
    per_word = 32 // bits
    for prefix, n, k in _int_modules(ctx, "GPTQ", lambda e: e.shape[0] * per_word, lambda e: e.shape[1]):
        qweight, logical = prefix + "qweight", prefix + "weight"
        g = k if group == -1 else group
        if k % g:
            raise ctx.error(qweight, f"group size {g} does not divide K = {k}")
        for part, shape, dtypes in (("qzeros", (k // g, n // per_word), ("I32",)),
                                    ("scales", (k // g, n), _FLOAT_SCALE_DTYPES)):
            ctx.need(prefix + part, qweight, part)
            ctx.expect(prefix + part, dtypes, shape, part)
        if n % per_word:
            raise ctx.error(qweight, f"N = {n} is not a multiple of {per_word} (qzeros pack {per_word} per word)")
        sources = [qweight, prefix + "qzeros", prefix + "scales"]
        has_g_idx = prefix + "g_idx" in ctx.entries
        if has_g_idx:
            ctx.expect(prefix + "g_idx", ("I32", "I64"), (k,), "g_idx")
            sources.append(prefix + "g_idx")
        elif q.get("desc_act"):
            raise ctx.error(qweight, f"desc_act is set but {prefix}g_idx is missing")
        ctx.add(Fold(logical, f"int{bits}_g", (n, k), (1, g), tuple(sources),
                     _gptq_build(ctx, prefix, bits, g, n, k, version == "gptq", has_g_idx)))


def _gptq_build(ctx: _Ctx, prefix: str, bits: int, g: int, n: int, k: int, v1: bool,
                has_g_idx: bool) -> Callable[[Reader], QuantizedTensor]:
    def build(read: Reader) -> QuantizedTensor:
        q = _unpack_words(read(prefix + "qweight").t(), bits)  # [N, K]: words run along K
        zeros = _unpack_words(read(prefix + "qzeros"), bits).t()  # [N, K/g]
        if v1:  # GPTQ v1 stores z - 1 (dequantizes s * (q - (z + 1)))
            if bits == 8 and (zeros == 255).any():
                raise ctx.error(prefix + "qzeros", "a GPTQ v1 zero point of 255 + 1 does not fit 8 bits; "
                                                   "save the checkpoint as gptq_v2")
            zeros = zeros + 1
        scales = _no_nan(ctx, prefix + "scales", read(prefix + "scales").float().t())  # [N, K/g]
        perm = _group_perm(ctx, prefix + "g_idx", read(prefix + "g_idx"), k, g) if has_g_idx else None
        return _int_weight(q, scales, zeros, bits, g, perm)

    return build


def _plan_awq(ctx: _Ctx) -> None:
    q = ctx.qconfig
    _check_keys(ctx, "quant_method 'awq'", q, _AWQ_KEYS)
    bits, group = _bits_group(ctx, (4,))
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version != "gemm":
        raise ctx.config_error(f"version {version!r} is not supported; supported: gemm")
    for prefix, n, k in _int_modules(ctx, "AWQ", lambda e: e.shape[0], lambda e: e.shape[1] * 8):
        qweight = prefix + "qweight"
        g = k if group == -1 else group
        if k % g:
            raise ctx.error(qweight, f"group size {g} does not divide K = {k}")
        ctx.need(prefix + "scales", qweight, "scales")
        ctx.expect(prefix + "scales", _FLOAT_SCALE_DTYPES, (k // g, n), "scales")
        sources = [qweight, prefix + "scales"]
        has_zeros = bool(q.get("zero_point", True))
        if has_zeros:
            ctx.need(prefix + "qzeros", qweight, "qzeros")
            ctx.expect(prefix + "qzeros", ("I32",), (k // g, n // 8), "qzeros")
            sources.append(prefix + "qzeros")
        ctx.add(Fold(prefix + "weight", "int4_g", (n, k), (1, g), tuple(sources),
                     _awq_build(ctx, prefix, g, n, k, has_zeros)))


def _awq_columns(n: int) -> torch.Tensor:
    """For logical column ``c`` of an AWQ word row, its position among the unpacked nibbles."""
    inverse = [AWQ_ORDER.index(m) for m in range(8)]  # column 8w + m sits in nibble inverse[m]
    cols = torch.arange(n)
    return cols // 8 * 8 + torch.tensor(inverse)[cols % 8]


def _awq_build(ctx: _Ctx, prefix: str, g: int, n: int, k: int, has_zeros: bool) -> Callable[[Reader], QuantizedTensor]:
    def build(read: Reader) -> QuantizedTensor:
        order = _awq_columns(n)
        q = _unpack_words(read(prefix + "qweight"), 4)[:, order].t()  # [N, K]
        if has_zeros:
            zeros = _unpack_words(read(prefix + "qzeros"), 4)[:, order].t()  # [N, K/g]
        else:
            zeros = torch.full((n, k // g), 8, dtype=torch.uint8)
        scales = _no_nan(ctx, prefix + "scales", read(prefix + "scales").float().t())
        return _int_weight(q, scales, zeros, 4, g, None)

    return build


# ---------------------------------------------------------------------- mxfp4 / modelopt


def _plan_mxfp4(ctx: _Ctx) -> None:
    _check_keys(ctx, "quant_method 'mxfp4'", ctx.qconfig, ("quant_method", "modules_to_not_convert"))
    for name, entry in list(ctx.entries.items()):
        if not name.endswith("_blocks"):
            continue
        logical = name.removesuffix("_blocks")
        ctx.need(logical + "_scales", name, "E8M0 scales")
        ctx.expect(name, ("U8",), None, "MXFP4 blocks")
        if len(entry.shape) < 3 or entry.shape[-1] != 16:
            raise ctx.error(name, f"MXFP4 blocks of shape {list(entry.shape)}; expected [..., rows, K/32, 16]")
        *lead, n, groups, _ = entry.shape
        ctx.expect(logical + "_scales", _E8M0_DTYPES, (*lead, n, groups), "E8M0 scales")
        shape = (*lead, n, groups * 32)

        def build(read: Reader, name: str = name, scales_name: str = logical + "_scales",
                  shape: tuple[int, ...] = shape) -> QuantizedTensor:
            s = read(scales_name).view(torch.uint8)
            if (s == 255).any():
                raise ctx.error(scales_name, "E8M0 scale byte 255 (NaN)")
            q = read(name).reshape(*shape[:-1], shape[-1] // 2)
            return QuantizedTensor({"qweight": q, "scales": s}, "mxfp4", shape)

        ctx.add(Fold(logical, "mxfp4", shape, None, (name, logical + "_scales"), build))


_MODELOPT_KEYS = ("quant_method", "quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules", "ignore",
                  "producer", "kv_cache_scheme")


def _plan_modelopt(ctx: _Ctx) -> None:
    q = ctx.qconfig
    _check_keys(ctx, "quant_method 'modelopt'", q, _MODELOPT_KEYS)
    if q.get("quant_algo") != "NVFP4":
        raise ctx.config_error(f"modelopt quant_algo {q.get('quant_algo')!r} is not supported; supported: NVFP4")
    if q.get("group_size", 16) != 16:
        raise ctx.config_error(f"NVFP4 group_size {q.get('group_size')!r}; NVFP4 blocks are 16")
    if q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme"):
        raise ctx.config_error("kv_cache_quant_algo (a quantized KV cache) is not supported")
    for name, entry in list(ctx.entries.items()):
        if not (name.endswith(".weight") and entry.dtype == "U8"):
            continue
        prefix = name.removesuffix("weight")
        ctx.need(prefix + "weight_scale", name, "NVFP4 block scale")
        ctx.need(prefix + "weight_scale_2", name, "NVFP4 global scale (weight_scale_2)")
        *lead, n, half = entry.shape
        k = 2 * half
        if k % 16:
            raise ctx.error(name, f"K = {k} is not a multiple of the NVFP4 block of 16")
        ctx.expect(prefix + "weight_scale", ("F8_E4M3",), (*lead, n, k // 16), "NVFP4 block scale")
        ctx.expect(prefix + "weight_scale_2", ("F32",), None, "NVFP4 global scale")
        shape = (*lead, n, k)

        def build(read: Reader, prefix: str = prefix, shape: tuple[int, ...] = shape) -> QuantizedTensor:
            s = read(prefix + "weight_scale").view(torch.uint8)
            _no_nan(ctx, prefix + "weight_scale", s.view(torch.float8_e4m3fn).float())
            gscale = _no_nan(ctx, prefix + "weight_scale_2", read(prefix + "weight_scale_2").float())
            return QuantizedTensor({"qweight": read(prefix + "weight"), "scales": s,
                                    "global_scale": gscale.reshape(shape[:-2])}, "nvfp4", shape)

        ctx.add(Fold(name, "nvfp4", shape, None, (name, prefix + "weight_scale", prefix + "weight_scale_2"), build))
        ctx.skip_activation_scales(prefix, ("input_scale",))


#: quant_method -> planner. Each adds its folds to the context.
METHODS: dict[str, Callable[[_Ctx], None]] = {
    "fp8": _plan_fp8,
    "compressed-tensors": _plan_compressed_tensors,
    "gptq": _plan_gptq,
    "awq": _plan_awq,
    "mxfp4": _plan_mxfp4,
    "modelopt": _plan_modelopt,
}


def plan_quantization(config_file: Path, qconfig: Any, entries: Mapping[str, Stored], read: Reader) -> QuantPlan:
    """Plan the folds of a quantized HF checkpoint from its headers.

    Args:
        config_file: ``config.json`` (named in config errors).
        qconfig: its ``quantization_config`` object.
        entries: checkpoint tensor name -> stored dtype, shape and file (safetensors headers).
        read: reads one checkpoint tensor (used at plan time only for the tiny
            ``weight_shape`` tensors of compressed-tensors' pack-quantized format).

    Returns:
        The :class:`QuantPlan`.

    Raises:
        CheckpointError: the method, a format or a field is unknown or unsupported (names it
            and lists the supported ones).
        TensorError: a weight's scale, zero point, ``g_idx`` or shape tensor is missing,
            mis-shaped or of the wrong dtype; a group size does not divide K; a packed shape
            disagrees with ``weight_shape``; an FP8 weight has no scale.
    """
    if not isinstance(qconfig, Mapping):
        raise CheckpointError(str(config_file), f"quantization_config must be an object, got {type(qconfig).__name__}")
    method = qconfig.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(str(config_file), f"quantization_config: quant_method {method!r} is not supported; "
                                                f"supported: {', '.join(METHODS)}")
    ctx = _Ctx(config_file, qconfig, entries, read)
    METHODS[method](ctx)
    return QuantPlan(str(method), ctx.folds, ctx.skipped)
