"""``quant_method: fp8`` (transformers' ``FineGrainedFP8Config``; DeepSeek-V3, Qwen3-FP8, AutoFP8
files), and the FP8 fold compressed-tensors' float-quantized format shares."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant.kv_cache import plan_kv_cache
from zllm.weights.hf_quant.plan import (
    E8M0_DTYPES,
    FLOAT_SCALE_DTYPES,
    Fold,
    PlanContext,
    Reader,
    block_shape,
    ceil_div,
    check_keys,
    scale_f32,
)

# ignored_layers and kv_cache_scheme ("static"): what AutoFP8's save_quantized_model writes.
_FP8_KEYS = ("quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype", "ignored_layers", "kv_cache_scheme")


def fp8_block(ctx: PlanContext, scale_name: str, scale_shape: tuple[int, ...], shape: tuple[int, ...],
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
        if scale_shape == (*lead_t, ceil_div(n, bn), ceil_div(k, bk)):
            return (bn, bk)
    wanted = [f"[{', '.join(map(str, (*lead_t, ceil_div(n, bn), ceil_div(k, bk))))}] for blocks ({bn}, {bk})"
              for bn, bk in blocks]
    per_channel = ", ".join(map(str, (*lead_t, n, 1)))
    blocks_text = f" nor {'; '.join(wanted)}" if wanted else ""
    raise ctx.error(scale_name, f"scale shape {list(scale_shape)} fits neither one scale per tensor nor per "
                    f"channel [{per_channel}]{blocks_text} of weight {list(shape)}")


def fp8_fold(ctx: PlanContext, weight: str, scale: str, block: tuple[int, int], shape: tuple[int, ...]) -> Fold:
    """The fold of FP8 ``weight`` with its ``scale`` (f32, or E8M0 bytes by stored dtype) per ``block``."""
    e8m0 = ctx.entries[scale].dtype in E8M0_DTYPES
    *lead, n, k = shape
    scale_shape = (*lead, ceil_div(n, block[0]), ceil_div(k, block[1]))

    def build(read: Reader) -> QuantizedTensor:
        q = read(weight).view(torch.uint8)
        s = scale_f32(ctx, scale, read(scale), e8m0).reshape(scale_shape).contiguous()
        return QuantizedTensor({"qweight": q, "scale": s}, "fp8_e4m3", shape, block=block)

    return Fold(weight, "fp8_e4m3", shape, block, (weight, scale), build)


def plan_fp8(ctx: PlanContext) -> None:
    """``quant_method: fp8``: every F8_E4M3 ``X.weight`` with its ``X.weight_scale_inv`` or ``X.weight_scale``."""
    q = ctx.qconfig
    check_keys(ctx, "quant_method 'fp8'", q, _FP8_KEYS)
    blocks: list[tuple[int, int]] = []
    if q.get("weight_block_size") is not None:
        blocks.append(block_shape(ctx, "weight_block_size", q["weight_block_size"]))
    if q.get("activation_scheme"):
        ctx.note_quantized_activations(f"FP8 E4M3 ({q['activation_scheme']} scales)")
    if q.get("kv_cache_scheme"):
        plan_kv_cache(ctx, "kv_cache_scheme", q["kv_cache_scheme"], ("static",))
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
        ctx.expect(scales[0], (*FLOAT_SCALE_DTYPES, *E8M0_DTYPES), None, "FP8 scale")
        if len(entry.shape) < 2:
            raise ctx.error(name, f"FP8 weight of shape {list(entry.shape)}; quantized weights have rows")
        block = fp8_block(ctx, scales[0], ctx.entries[scales[0]].shape, entry.shape, blocks)
        ctx.add(fp8_fold(ctx, name, scales[0], block, entry.shape))
        ctx.skip_activation_scales(prefix, ("activation_scale", "input_scale"))
