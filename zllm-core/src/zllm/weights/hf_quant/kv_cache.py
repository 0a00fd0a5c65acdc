"""A quantized KV cache that a checkpoint's config declares: zllm keeps the cache in
``runtime.kv_cache.dtype`` and leaves the checkpoint's FP8 K/V scales unapplied, as vLLM does
with its default ``kv_cache_dtype: auto``.

Declarations (an FP8 E4M3 cache, static per-tensor or per-head scales):

- modelopt: ``kv_cache_quant_algo: FP8`` (``hf_quant_config.json`` and older ``config.json``),
  ``kv_cache_scheme: "FP8"`` or ``{"num_bits": 8, "type": "float", ...}`` (what
  ``convert_hf_quant_config_format`` writes into ``config.json``);
- compressed-tensors: ``kv_cache_scheme`` as ``QuantizationArgs`` (float, 8 bits, symmetric,
  strategy ``tensor`` or ``attn_head``, the KV caches vLLM's ``CompressedTensorsKVCacheMethod``
  accepts);
- ``fp8`` (AutoFP8's ``save_quantized_model``): ``kv_cache_scheme: "static"``.

Scale tensors, the names vLLM's ``maybe_remap_kv_scale_name`` reads: ``A.k_scale`` and
``A.v_scale`` on the attention module ``A`` (compressed-tensors, AutoFP8), or
``A.k_proj.k_scale`` and ``A.v_proj.v_scale`` (modelopt's export). Each is one value, or one per
KV head (``[H, 1, 1]``: compressed-tensors' ``attn_head``), in a float dtype. They are skipped
with :data:`KV_SCALE_REASON` only when the config declares the cache, and only on a module that
holds other tensors of the checkpoint: any other ``*_scale`` stays a stray tensor that fails as
unused. Another KV-cache format (int8, NVFP4, asymmetric) is a config error naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zllm.weights.hf_quant.plan import CT_ARGS_KEYS, FLOAT_SCALE_DTYPES, PlanContext, check_keys

KV_SCALE_REASON = ("FP8 KV-cache scale: not applied, the KV cache is kept in runtime.kv_cache.dtype "
                   "(as vLLM does with kv_cache_dtype auto)")
_KV_STRATEGIES = (None, "tensor", "attn_head")
_KV_SCALES = ("k_scale", "v_scale")


def kv_cache_note(scheme: str, kv_dtype: str) -> str:
    """The ``--explain`` line for a checkpoint whose config declares an FP8 KV cache ``scheme``
    (``"kv_cache_quant_algo: FP8"``), run with a KV cache of ``kv_dtype`` (``f32``, ``f16``, ``bf16``)."""
    return (f"the checkpoint's FP8 KV-cache scales ({scheme}) are not applied: the KV cache is kept in {kv_dtype} "
            "(runtime.kv_cache.dtype), as vLLM keeps it with kv_cache_dtype auto; an FP8 KV cache is not supported")


def plan_kv_cache(ctx: PlanContext, field: str, value: Any, names: tuple[str, ...]) -> None:
    """Accept the quantized KV cache that config field ``field`` declares as ``value`` when it is
    FP8 — one of the strings ``names`` or compressed-tensors ``QuantizationArgs`` of an 8-bit
    float — and skip the checkpoint's K/V scale tensors (recording :attr:`PlanContext.kv_cache`).

    Raises:
        CheckpointError: ``value`` declares another KV-cache format or has an unknown field.
        TensorError: a K/V scale is stored in a non-float dtype or holds more than one value per
            KV head.
    """
    if isinstance(value, str):
        if value not in names:
            allowed = "".join(f"{n!r} or " for n in names)
            raise ctx.config_error(f"{field} {value!r} is not supported; supported: {allowed}float 8-bit "
                                   "QuantizationArgs (an FP8 KV cache, whose scales are not applied)")
        scheme = f"{field}: {value}"
    elif isinstance(value, Mapping):
        check_keys(ctx, field, value, CT_ARGS_KEYS)
        bits, kind, strategy = value.get("num_bits"), value.get("type"), value.get("strategy")
        if kind != "float" or bits != 8 or value.get("symmetric", True) is not True or strategy not in _KV_STRATEGIES:
            raise ctx.config_error(f"{field} {kind} {bits}-bit (strategy {strategy!r}, symmetric "
                                   f"{value.get('symmetric', True)}) is not supported: an FP8 KV cache (type float, "
                                   "8 bits, symmetric, strategy tensor or attn_head) is, with its scales not applied")
        scheme = f"{field}: float8 per {'KV head' if strategy == 'attn_head' else 'tensor'}"
    else:
        raise ctx.config_error(f"{field} must be a string or an object, got {type(value).__name__}")
    ctx.kv_cache = scheme
    modules = _modules_holding_tensors(ctx)
    for name, entry in ctx.entries.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in _KV_SCALES or module not in modules:
            continue
        ctx.expect(name, FLOAT_SCALE_DTYPES, None, "KV-cache scale")
        if math.prod(entry.shape) != 1 and not (len(entry.shape) == 3 and entry.shape[1:] == (1, 1)):
            raise ctx.error(name, f"KV-cache scale has shape {list(entry.shape)}; expected one value per tensor "
                                  "or one per KV head [H, 1, 1]")
        ctx.skipped[name] = KV_SCALE_REASON


def _modules_holding_tensors(ctx: PlanContext) -> set[str]:
    """Every module (dotted prefix) that holds a checkpoint tensor other than a K/V scale."""
    modules: set[str] = set()
    for name in ctx.entries:
        parts = name.split(".")
        if parts[-1] not in _KV_SCALES:
            modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return modules
