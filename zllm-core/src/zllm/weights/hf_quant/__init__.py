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
- ``compressed-tensors`` (``format`` per config group or global; ``naive-quantized`` is the
  layout ``float-quantized`` and ``int-quantized`` alias): ``float-quantized`` (F8
  ``weight`` + ``weight_scale``, strategy tensor/channel/block/group); ``int-quantized`` (W8A8:
  I8 ``weight`` ``[N, K]`` + ``weight_scale`` per tensor, ``[N, 1]`` or ``[N, K/g]``, I8
  ``weight_zero_point`` alike when asymmetric; run weight-only); ``pack-quantized``
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
  ``[N, K/16]``, ``weight_scale_2`` F32 (the kernel's ``global_scale``); ``quant_algo: FP8``:
  ``weight`` F8_E4M3 ``[N, K]``, ``weight_scale`` F32 scalar.

Static activation scales (``input_scale``, ``activation_scale``, ``input_global_scale``,
``input_zero_point``) are read by nobody: zllm's quantized kernels take f32 activations (the
dequantized-weight semantics), so they are skipped with that reason in ``--explain``; a config
that quantizes activations (W8A8, modelopt FP8/NVFP4) adds a :attr:`QuantPlan.notes` line saying
they stay f32. A config that declares an FP8 KV cache (modelopt ``kv_cache_quant_algo``,
``kv_cache_scheme``) has its K/V scales skipped the same way and the cache kept in
``runtime.kv_cache.dtype`` (:mod:`zllm.weights.hf_quant.kv_cache`). Modules a config leaves
unquantized (``ignore``, ``modules_to_not_convert``, ``exclude_modules``) simply hold dense
tensors and stay dense.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zllm.spec.errors import CheckpointError
from zllm.weights.hf_quant.compressed_tensors import CT_FORMATS, plan_compressed_tensors
from zllm.weights.hf_quant.fp4 import plan_mxfp4
from zllm.weights.hf_quant.fp8 import plan_fp8
from zllm.weights.hf_quant.gptq_awq import plan_awq, plan_gptq
from zllm.weights.hf_quant.modelopt import plan_modelopt
from zllm.weights.hf_quant.plan import ACTIVATION_SCALE_REASON, AWQ_ORDER, Fold, PlanContext, QuantPlan, Reader, Stored

__all__ = ["ACTIVATION_SCALE_REASON", "AWQ_ORDER", "CT_FORMATS", "METHODS", "Fold", "QuantPlan", "Reader", "Stored",
           "plan_quantization"]

#: quant_method -> planner. Each adds its folds to the context.
METHODS: dict[str, Callable[[PlanContext], None]] = {
    "fp8": plan_fp8,
    "compressed-tensors": plan_compressed_tensors,
    "gptq": plan_gptq,
    "awq": plan_awq,
    "mxfp4": plan_mxfp4,
    "modelopt": plan_modelopt,
}


def _unfolded_example(entries: Mapping[str, Stored]) -> str:
    """What a checkpoint that folds no weight holds instead: a weight in a dtype no method folds
    (F8_E5M2), else a decoder layer's dense weight, for the error's message."""
    weights = [(n, e) for n, e in entries.items() if n.endswith(".weight") and len(e.shape) >= 2]
    odd = [(n, e) for n, e in weights if e.dtype not in ("F32", "F16", "BF16")]
    if odd:
        return f" ({odd[0][0]} is stored as {odd[0][1].dtype})"
    dense = [(n, e) for n, e in weights if ".layers." in n] or weights
    if dense:
        name, entry = dense[0]
        return f" ({name} is stored as {entry.dtype}); remove quantization_config to load the weights dense"
    return ""


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
            and lists the supported ones); no tensor is quantized although the config
            quantizes weights.
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
    ctx = PlanContext(config_file, qconfig, entries, read)
    METHODS[method](ctx)
    for fold in ctx.folds.values():
        if fold.name in entries and fold.name not in fold.sources:
            # The fold would shadow it: a stored tensor never read and never reported unused.
            raise ctx.error(fold.name, f"stored beside the quantized parts of the same weight "
                                       f"({', '.join(fold.sources)}); a checkpoint holds one or the other")
    if not ctx.folds and ctx.kv_cache is None:
        # A config that quantizes only the KV cache (compressed-tensors' kv_cache_scheme with no
        # config groups) keeps its weights dense; any other without one quantized tensor
        # disagrees with its own files (a dequantized copy that kept the config): say so
        # rather than run dense weights under a quantization label.
        raise CheckpointError(str(config_file), f"quantization_config says quant_method {method!r}, but no tensor "
                                                f"is stored as it quantizes{_unfolded_example(entries)}")
    return QuantPlan(str(method), ctx.folds, ctx.skipped, tuple(ctx.notes), ctx.kv_cache)
