"""``quant_method: compressed-tensors``: float-quantized, int-quantized (W8A8 int8), naive-quantized,
pack-quantized, nvfp4- and mxfp4-pack-quantized weights, matched to their config groups.

``naive-quantized`` is the unpacked layout that compressed-tensors' ``int-quantized`` and
``float-quantized`` compressors are aliases of (``NaiveQuantizationCompressor``: the weight cast
to ``QuantizationArgs.pytorch_dtype()``, I8 or F8_E4M3, beside ``weight_scale`` and an optional
``weight_zero_point``); it is what compressed-tensors picks for a weight-only FP8 scheme. Its
weights fold as those two formats' do."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant.fp8 import fp8_block, fp8_fold
from zllm.weights.hf_quant.kv_cache import plan_kv_cache
from zllm.weights.hf_quant.plan import (
    CT_ARGS_KEYS,
    E8M0_DTYPES,
    FLOAT_SCALE_DTYPES,
    Fold,
    PlanContext,
    Reader,
    block_shape,
    ceil_div,
    check_keys,
    finite_scale,
    flag,
    group_perm,
    int_weight,
    positive_int,
    unpack_words,
)

_CT_KEYS = ("quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
            "global_compression_ratio", "sparsity_config", "moe_sparsity_config", "transform_config", "version",
            "provider")
_CT_GROUP_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized",
              "mxfp4-pack-quantized")


@attrs.frozen
class _CtGroup:
    targets: tuple[str, ...]
    weights: Mapping[str, Any]
    format: str | None


def _ct_groups(ctx: PlanContext) -> list[_CtGroup]:
    q = ctx.qconfig
    check_keys(ctx, "quant_method 'compressed-tensors'", q, _CT_KEYS)
    for key in ("sparsity_config", "moe_sparsity_config"):
        if q.get(key):
            raise ctx.config_error(f"{key} (sparse compressed-tensors checkpoints) is not supported")
    if q.get("kv_cache_scheme"):
        plan_kv_cache(ctx, "kv_cache_scheme", q["kv_cache_scheme"], ())
    status = q.get("quantization_status")
    if status is not None and status != "compressed":
        # frozen / decompressed: dense weights beside scales that compressed-tensors applies by
        # quantizing and dequantizing the weight in each forward; the folds read compressed tensors.
        raise ctx.config_error(f"quantization_status {status!r} (weights saved uncompressed, fake-quantized) is not "
                               "supported; supported: 'compressed'")
    if q.get("transform_config"):
        raise ctx.config_error("transform_config (rotated weights) is not supported")
    groups = []
    config_groups = q.get("config_groups") or {}
    if not isinstance(config_groups, Mapping):
        raise ctx.config_error(f"config_groups must be an object of named groups, got {type(config_groups).__name__}")
    for gname, group in config_groups.items():
        check_keys(ctx, f"config_groups.{gname}", group, _CT_GROUP_KEYS)
        weights = group.get("weights") or {}
        check_keys(ctx, f"config_groups.{gname}.weights", weights, CT_ARGS_KEYS)
        _check_num_bits(ctx, f"config_groups.{gname}.weights", weights)
        flag(ctx, f"config_groups.{gname}.weights.", weights, "symmetric", True)
        fmt = group.get("format") or q.get("format")
        group_size = weights.get("group_size")
        if weights.get("strategy") in ("group", "tensor_group") and not positive_int(group_size):
            # compressed-tensors' QuantizationArgs refuses a missing or non-positive one too;
            # read as they were, none meant one group per row and -1 a negative group count.
            raise ctx.config_error(f"config_groups.{gname}.weights: strategy {weights['strategy']!r} needs a "
                                   f"group_size that is a positive integer, got {group_size!r}")
        if weights and fmt not in CT_FORMATS:
            raise ctx.config_error(f"format {fmt!r} (config_groups.{gname}) is not supported; supported: "
                                   f"{', '.join(CT_FORMATS)}")
        activations = group.get("input_activations")
        if activations:
            check_keys(ctx, f"config_groups.{gname}.input_activations", activations, CT_ARGS_KEYS)
            _check_num_bits(ctx, f"config_groups.{gname}.input_activations", activations)
            ctx.note_quantized_activations(_activations_text(activations))
        if not isinstance(group.get("targets") or [], list):
            raise ctx.config_error(f"config_groups.{gname}.targets: {group['targets']!r} is not a list")
        targets = tuple(group.get("targets") or ())
        for target in targets:
            if not isinstance(target, str):
                raise ctx.config_error(f"config_groups.{gname}.targets: {target!r} is not a string")
            if target.startswith("re:"):
                try:
                    re.compile(target[3:])
                except re.error as e:
                    raise ctx.config_error(f"config_groups.{gname}.targets: {target!r} is not a valid regular "
                                           f"expression: {e}") from None
        groups.append(_CtGroup(targets, weights, fmt))
    return groups


def _check_num_bits(ctx: PlanContext, where: str, args: Mapping[str, Any]) -> None:
    """A config error unless ``args``' ``num_bits`` (at ``where``) is absent or a positive integer:
    ``int()`` of a string raised ValueError, and 4.5 bits were read as 4."""
    bits = args.get("num_bits")
    if bits is not None and not positive_int(bits):
        raise ctx.config_error(f"{where}.num_bits must be a positive integer, got {bits!r}")


def _activations_text(args: Mapping[str, Any]) -> str:
    """``"int8 per token (dynamic)"``: what a group's ``input_activations`` quantize to."""
    kind = "int" if args.get("type", "int") == "int" else "float"
    dynamic = args.get("dynamic") in (True, "local")
    return f"{kind}{args.get('num_bits')} per {args.get('strategy') or 'tensor'} ({'dynamic' if dynamic else 'static'})"


def _ct_group_of(ctx: PlanContext, groups: list[_CtGroup], module: str) -> _CtGroup:
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


def _ct_float(ctx: PlanContext, prefix: str, group: _CtGroup) -> None:
    name, scale = prefix + "weight", prefix + "weight_scale"
    entry = ctx.entries[name]
    ctx.need(scale, name, "FP8 scale")
    ctx.expect(scale, FLOAT_SCALE_DTYPES, None, "FP8 scale")
    bits, kind, strategy, _, group_size = _ct_args(group)
    if kind != "float" or bits != 8:
        raise ctx.config_error(f"{group.format} {kind} with {bits} bits is not supported (float with 8 bits is)")
    if len(entry.shape) < 2:
        raise ctx.error(name, f"FP8 weight of shape {list(entry.shape)}; quantized weights have rows")
    blocks: list[tuple[int, int]] = []
    if strategy == "block":
        blocks.append(block_shape(ctx, "strategy 'block': block_structure", group.weights.get("block_structure")))
    elif strategy == "group" and group_size:
        blocks.append((1, int(group_size)))
    block = fp8_block(ctx, scale, ctx.entries[scale].shape, entry.shape, blocks)
    ctx.add(fp8_fold(ctx, name, scale, block, entry.shape))
    ctx.skip_activation_scales(prefix, ("input_scale",))


def _ct_int(ctx: PlanContext, prefix: str, group: _CtGroup) -> None:
    """int-quantized (W8A8) or naive-quantized int8: ``weight`` I8 ``[N, K]`` as it is, ``weight_scale`` one value per
    tensor, ``[N, 1]`` per channel or ``[N, K/g]`` per group, ``weight_zero_point`` I8 alike when
    asymmetric -> ``int8_g``, the int8 values offset by 128 (``q + 128 - (zp + 128)`` is exact)."""
    name, scale = prefix + "weight", prefix + "weight_scale"
    entry = ctx.entries[name]
    bits, kind, strategy, symmetric, group_size = _ct_args(group)
    if kind != "int" or bits != 8:
        raise ctx.config_error(f"{group.format} {kind} with {bits} bits is not supported (int with 8 bits is)")
    if len(entry.shape) != 2:
        raise ctx.error(name, f"int8 weight of shape {list(entry.shape)}; expected [N, K]")
    n, k = entry.shape
    if strategy == "group" and group_size and group_size > 0:
        g = int(group_size)
        if k % g:
            raise ctx.error(name, f"group size {g} does not divide K = {k}")
    elif strategy in ("channel", "tensor", "None"):  # no strategy: compressed-tensors' default, tensor
        g = k
    else:
        raise ctx.config_error(f"{group.format} strategy {strategy!r} is not supported (tensor, channel, group are)")
    per_tensor = strategy in ("tensor", "None")
    shapes = ((), (1,), (1, 1)) if per_tensor else ((n, k // g),)
    parts: list[tuple[str, str, tuple[str, ...]]] = [(scale, "scale", FLOAT_SCALE_DTYPES)]
    if not symmetric:
        parts.append((prefix + "weight_zero_point", "zero point", ("I8",)))
    for part, what, dtypes in parts:
        ctx.need(part, name, what)
        ctx.expect(part, dtypes, None, what)
        if ctx.entries[part].shape not in shapes:
            raise ctx.error(part, f"{what} has shape {list(ctx.entries[part].shape)}; expected "
                                  f"{' or '.join(str(list(s)) for s in shapes)} for strategy {strategy!r}")

    def build(read: Reader) -> QuantizedTensor:
        q = read(name).view(torch.uint8) ^ 0x80  # int8 v -> unsigned v + 128 (two's complement)
        scales = finite_scale(ctx, scale, read(scale).float()).reshape(-1, k // g).expand(n, k // g)
        if symmetric:
            zeros = torch.full((n, k // g), 128, dtype=torch.uint8)
        else:
            zeros = (read(prefix + "weight_zero_point").view(torch.uint8) ^ 0x80).reshape(-1, k // g).expand(n, k // g)
        return QuantizedTensor({"qweight": q, "scales": scales.contiguous(), "zeros": zeros.contiguous()},
                               "int8_g", (n, k), block=(1, g))

    ctx.add(Fold(name, "int8_g", (n, k), (1, g), (name, *(p for p, _, _ in parts)), build))
    ctx.skip_activation_scales(prefix, ("input_scale", "input_zero_point"))


def _ct_pack(ctx: PlanContext, prefix: str, group: _CtGroup) -> None:
    packed, logical = prefix + "weight_packed", prefix + "weight"
    bits, kind, strategy, symmetric, group_size = _ct_args(group)
    if kind != "int" or bits not in (4, 8):
        raise ctx.config_error(f"pack-quantized {kind} with {bits} bits is not supported (int with 4 or 8 bits is)")
    shape_name = prefix + "weight_shape"
    ctx.need(shape_name, packed, "the logical shape")
    ctx.expect(shape_name, ("I64", "I32"), (2,), "weight_shape")
    n, k = (int(v) for v in ctx.read(shape_name).tolist())
    if n < 1 or k < 1:
        raise ctx.error(shape_name, f"weight_shape [{n}, {k}] is not a shape: both sizes must be positive")
    ctx.expect(packed, ("I32",), None, "packed weight")
    if ctx.entries[packed].shape != (n, ceil_div(k * bits, 32)):
        raise ctx.error(packed, f"packed shape {list(ctx.entries[packed].shape)} disagrees with weight_shape "
                                f"[{n}, {k}] at {bits} bits: expected [{n}, {ceil_div(k * bits, 32)}]")
    g = int(group_size) if strategy == "group" and group_size else k
    if strategy not in ("group", "channel"):
        raise ctx.config_error(f"pack-quantized strategy {strategy!r} is not supported (group, channel are)")
    if k % g or (bits == 4 and k % 2):
        raise ctx.error(packed, f"group size {g} does not divide K = {k}" if k % g else f"odd K = {k} at 4 bits")
    scale = ctx.need(prefix + "weight_scale", packed, "scale")
    if scale.shape not in ((n, k // g),):
        raise ctx.error(prefix + "weight_scale", f"scale has shape {list(scale.shape)}; expected [{n}, {k // g}]")
    ctx.expect(prefix + "weight_scale", FLOAT_SCALE_DTYPES, None, "scale")
    sources = [packed, prefix + "weight_scale", shape_name]
    zp_name = prefix + "weight_zero_point"
    if not symmetric:
        ctx.need(zp_name, packed, "zero point")
        ctx.expect(zp_name, ("I32",), (ceil_div(n * bits, 32), k // g), "zero point")
        sources.append(zp_name)
    g_idx_name = prefix + "weight_g_idx"
    if g_idx_name in ctx.entries:
        ctx.expect(g_idx_name, ("I32", "I64"), (k,), "g_idx")
        sources.append(g_idx_name)
    offset = 1 << (bits - 1)

    def build(read: Reader) -> QuantizedTensor:
        words = read(packed)  # int32 [N, ceil(K*b/32)]
        scales = finite_scale(ctx, prefix + "weight_scale", read(prefix + "weight_scale").float())
        if symmetric:
            zeros = torch.full((n, k // g), offset, dtype=torch.uint8)
        else:  # packed along N: words [ceil(N*b/32), K/g]
            zeros = unpack_words(read(zp_name).t(), bits)[:, :n].t()  # [N, K/g] unsigned
        perm = group_perm(ctx, g_idx_name, read(g_idx_name), k, g) if g_idx_name in ctx.entries else None
        if perm is None:
            # The little-endian bytes of the words already are the kernel layout (low nibble =
            # even column): the file mapping is used as it is, copied only to drop padding.
            qweight = words.reshape(-1).view(torch.uint8).reshape(n, -1)[:, : k * bits // 8].contiguous()
            return QuantizedTensor({"qweight": qweight, "scales": scales.contiguous(), "zeros": zeros.contiguous()},
                                   f"int{bits}_g", (n, k), block=(1, g))
        q = unpack_words(words, bits)[:, :k]  # [N, K] unsigned: value + offset
        return int_weight(q, scales, zeros, bits, g, perm)

    ctx.add(Fold(logical, f"int{bits}_g", (n, k), (1, g), tuple(sources), build))
    ctx.skip_activation_scales(prefix, ("input_scale", "input_global_scale"))


def _ct_fp4(ctx: PlanContext, prefix: str, group: _CtGroup, fmt: str) -> None:
    packed, logical, scale = prefix + "weight_packed", prefix + "weight", prefix + "weight_scale"
    bits, kind, _, _, group_size = _ct_args(group)
    gs = 16 if fmt == "nvfp4" else 32
    if kind != "float" or bits != 4 or group_size != gs:
        raise ctx.config_error(f"{fmt}-pack-quantized needs float weights of 4 bits in groups of {gs}; "
                               f"config says {kind} with {bits} bits in groups of {group_size}")
    entry = ctx.expect(packed, ("U8",), None, "packed FP4 weight")
    if len(entry.shape) < 2:
        raise ctx.error(packed, f"packed FP4 weight of shape {list(entry.shape)}; expected [..., N, K/2]")
    *lead, n, half = entry.shape
    k = 2 * half
    ctx.need(scale, packed, "block scale")
    ctx.expect(scale, ("F8_E4M3",) if fmt == "nvfp4" else E8M0_DTYPES, (*lead, n, k // gs), "block scale")
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
            finite_scale(ctx, scale, parts["scales"].view(torch.float8_e4m3fn).float())
            gscale = finite_scale(ctx, glob, read(glob).float()).reshape(tuple(lead))
            if (gscale == 0).any():
                raise ctx.error(glob, "weight_global_scale 0 has no reciprocal")
            parts["global_scale"] = 1.0 / gscale
        return QuantizedTensor(parts, fmt, shape)

    ctx.add(Fold(logical, fmt, shape, None, tuple(sources), build))
    ctx.skip_activation_scales(prefix, ("input_global_scale", "input_scale"))


#: Unpacked quantized weights by stored dtype: what the weight is, the ``format`` that stores
#: it (``naive-quantized``, their common compressor, stores it alike) and its fold.
_UNPACKED = {"F8_E4M3": ("FP8", "float-quantized", _ct_float), "I8": ("int8", "int-quantized", _ct_int)}


def plan_compressed_tensors(ctx: PlanContext) -> None:
    """``quant_method: compressed-tensors``: every ``X.weight_packed`` and F8 ``X.weight``, by its group's format."""
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
        elif name.endswith(".weight") and entry.dtype in _UNPACKED:
            kind, fmt, fold = _UNPACKED[entry.dtype]
            prefix = name.removesuffix("weight")
            group = _ct_group_of(ctx, groups, prefix.rstrip("."))
            if group.format not in (fmt, "naive-quantized"):
                raise ctx.error(name, f"{kind} weight, but its config group's format is {group.format!r}")
            fold(ctx, prefix, group)
