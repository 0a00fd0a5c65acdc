"""``quant_method: modelopt`` (NVIDIA ModelOpt's unified HF export, ``config.json``'s
``quantization_config`` or an older export's ``hf_quant_config.json``) with ``quant_algo: NVFP4``
or ``FP8``."""

from __future__ import annotations

import math

import torch

from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant.fp8 import fp8_fold
from zllm.weights.hf_quant.kv_cache import plan_kv_cache
from zllm.weights.hf_quant.plan import Fold, PlanContext, Reader, check_keys, finite_scale

# config_groups / quant_library: what modelopt's convert_hf_quant_config_format adds to the
# config.json it writes (a compressed-tensors-like restatement of quant_algo, which decides here).
_MODELOPT_KEYS = ("quant_method", "quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules", "ignore",
                  "producer", "kv_cache_scheme", "config_groups", "quant_library")
_MODELOPT_ALGOS = ("FP8", "NVFP4")


def plan_modelopt(ctx: PlanContext) -> None:
    """``quant_method: modelopt``: ``quant_algo: NVFP4`` (every U8 ``X.weight`` with its two scales)
    or ``FP8`` (every F8_E4M3 ``X.weight`` with its per-tensor ``X.weight_scale``)."""
    q = ctx.qconfig
    check_keys(ctx, "quant_method 'modelopt'", q, _MODELOPT_KEYS)
    algo = q.get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise ctx.config_error(f"modelopt quant_algo {algo!r} is not supported; "
                               f"supported: {', '.join(_MODELOPT_ALGOS)}")
    # kv_cache_quant_algo decides, as quant_algo does; config.json's restatement of it is
    # kv_cache_scheme ("FP8" from older modelopt, QuantizationArgs from newer).
    for field in ("kv_cache_quant_algo", "kv_cache_scheme"):
        if q.get(field):
            plan_kv_cache(ctx, field, q[field], ("FP8",))
            break
    if algo == "FP8":
        _modelopt_fp8(ctx)
    else:
        _modelopt_nvfp4(ctx)


def _modelopt_fp8(ctx: PlanContext) -> None:
    """modelopt ``FP8``: ``weight`` F8_E4M3 ``[N, K]``, ``weight_scale`` F32 one value per tensor
    (``w = e4m3(q) * weight_scale``, as vLLM's ``ModelOptFp8LinearMethod``), a static ``input_scale``."""
    ctx.note_quantized_activations("FP8 E4M3 with a static per-tensor input_scale")
    for name, entry in list(ctx.entries.items()):
        if not (name.endswith(".weight") and entry.dtype == "F8_E4M3"):
            continue
        prefix = name.removesuffix("weight")
        scale = prefix + "weight_scale"
        ctx.need(scale, name, "FP8 per-tensor scale")
        ctx.expect(scale, ("F32",), None, "FP8 per-tensor scale")
        if len(entry.shape) != 2:
            raise ctx.error(name, f"FP8 weight of shape {list(entry.shape)}; expected [N, K]")
        if math.prod(ctx.entries[scale].shape) != 1:
            raise ctx.error(scale, f"scale shape {list(ctx.entries[scale].shape)}: modelopt FP8 has one scale per "
                                   "tensor (a scalar)")
        n, k = entry.shape
        ctx.add(fp8_fold(ctx, name, scale, (n, k), (n, k)))  # the per-tensor block: the whole weight
        ctx.skip_activation_scales(prefix, ("input_scale",))


def _modelopt_nvfp4(ctx: PlanContext) -> None:
    q = ctx.qconfig
    if q.get("group_size", 16) != 16:
        raise ctx.config_error(f"NVFP4 group_size {q.get('group_size')!r}; NVFP4 blocks are 16")
    ctx.note_quantized_activations("NVFP4 with a static input_scale")
    for name, entry in list(ctx.entries.items()):
        if not (name.endswith(".weight") and entry.dtype == "U8"):
            continue
        prefix = name.removesuffix("weight")
        ctx.need(prefix + "weight_scale", name, "NVFP4 block scale")
        ctx.need(prefix + "weight_scale_2", name, "NVFP4 global scale (weight_scale_2)")
        if len(entry.shape) < 2:
            raise ctx.error(name, f"NVFP4 weight of shape {list(entry.shape)}; expected [..., N, K/2]")
        *lead, n, half = entry.shape
        k = 2 * half
        if k % 16:
            raise ctx.error(name, f"K = {k} is not a multiple of the NVFP4 block of 16")
        ctx.expect(prefix + "weight_scale", ("F8_E4M3",), (*lead, n, k // 16), "NVFP4 block scale")
        ctx.expect(prefix + "weight_scale_2", ("F32",), None, "NVFP4 global scale")
        shape = (*lead, n, k)

        def build(read: Reader, prefix: str = prefix, shape: tuple[int, ...] = shape) -> QuantizedTensor:
            s = read(prefix + "weight_scale").view(torch.uint8)
            finite_scale(ctx, prefix + "weight_scale", s.view(torch.float8_e4m3fn).float())
            gscale = finite_scale(ctx, prefix + "weight_scale_2", read(prefix + "weight_scale_2").float())
            return QuantizedTensor({"qweight": read(prefix + "weight"), "scales": s,
                                    "global_scale": gscale.reshape(shape[:-2])}, "nvfp4", shape)

        ctx.add(Fold(name, "nvfp4", shape, None, (name, prefix + "weight_scale", prefix + "weight_scale_2"), build))
        ctx.skip_activation_scales(prefix, ("input_scale",))
