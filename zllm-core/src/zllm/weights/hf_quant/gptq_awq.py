"""``quant_method: gptq`` (v1 and v2, act-order) and ``quant_method: awq`` (``gemm``): integer
words packed along K (GPTQ) or along N in AWQ's interleaved order, unpacked once at load."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant.plan import (
    AWQ_ORDER,
    FLOAT_SCALE_DTYPES,
    Fold,
    PlanContext,
    Reader,
    Stored,
    check_keys,
    finite_scale,
    flag,
    group_perm,
    int_weight,
    positive_int,
    unpack_words,
)

_GPTQ_KEYS = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format",
              "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
              "model_file_base_name", "tokenizer", "dataset", "act_group_aware", "meta", "backend", "model_seqlen",
              "block_name_to_quantize", "module_name_preceding_first_block", "batch_size", "pad_token_id",
              "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize", "use_exllama",
              "exllama_config", "use_cuda_fp16", "pack_dtype", "lm_head", "mse", "v2", "hyb_act",
              "modules_to_not_convert")
_AWQ_KEYS = (*_GPTQ_KEYS, "zero_point", "version", "do_fuse", "fuse_max_seq_len", "modules_to_fuse")


def _bits_group(ctx: PlanContext, allowed_bits: tuple[int, ...]) -> tuple[int, int]:
    bits, group = ctx.qconfig.get("bits"), ctx.qconfig.get("group_size", 128)
    if bits not in allowed_bits:
        raise ctx.config_error(f"bits {bits!r} is not supported for {ctx.qconfig['quant_method']!r}; supported: "
                               f"{', '.join(map(str, allowed_bits))}")
    if not (positive_int(group) or (type(group) is int and group == -1)):
        raise ctx.config_error(f"group_size must be a positive integer or -1, got {group!r}")
    return bits, group


def _int_modules(ctx: PlanContext, what: str, k_of: Callable[[Stored], int], n_of: Callable[[Stored], int],
                 ) -> Iterable[tuple[str, int, int]]:
    """``(prefix, N, K)`` of each module with a ``qweight``."""
    for name, entry in list(ctx.entries.items()):
        if name.endswith(".qweight"):
            ctx.expect(name, ("I32",), None, f"{what} qweight")
            if len(entry.shape) != 2:
                raise ctx.error(name, f"{what} qweight of shape {list(entry.shape)}; expected 2-D")
            yield name.removesuffix("qweight"), n_of(entry), k_of(entry)


def plan_gptq(ctx: PlanContext) -> None:
    """``quant_method: gptq``: every ``X.qweight`` with ``X.qzeros``, ``X.scales`` and ``X.g_idx`` -> ``X.weight``."""
    q = ctx.qconfig
    check_keys(ctx, "quant_method 'gptq'", q, _GPTQ_KEYS)
    bits, group = _bits_group(ctx, (4, 8))
    version = q.get("checkpoint_format") or q.get("format") or "gptq"
    desc_act = flag(ctx, "", q, "desc_act", False)
    flag(ctx, "", q, "sym", True)  # the zero points are stored either way
    if version not in ("gptq", "gptq_v2"):
        raise ctx.config_error(f"checkpoint_format {version!r} is not supported; supported: gptq, gptq_v2")
    per_word = 32 // bits
    for prefix, n, k in _int_modules(ctx, "GPTQ", lambda e: e.shape[0] * per_word, lambda e: e.shape[1]):
        qweight, logical = prefix + "qweight", prefix + "weight"
        g = k if group == -1 else group
        if k % g:
            raise ctx.error(qweight, f"group size {g} does not divide K = {k}")
        for part, shape, dtypes in (("qzeros", (k // g, n // per_word), ("I32",)),
                                    ("scales", (k // g, n), FLOAT_SCALE_DTYPES)):
            ctx.need(prefix + part, qweight, part)
            ctx.expect(prefix + part, dtypes, shape, part)
        if n % per_word:
            raise ctx.error(qweight, f"N = {n} is not a multiple of {per_word} (qzeros pack {per_word} per word)")
        sources = [qweight, prefix + "qzeros", prefix + "scales"]
        has_g_idx = prefix + "g_idx" in ctx.entries
        if has_g_idx:
            ctx.expect(prefix + "g_idx", ("I32", "I64"), (k,), "g_idx")
            sources.append(prefix + "g_idx")
        elif desc_act:
            raise ctx.error(qweight, f"desc_act is set but {prefix}g_idx is missing")
        ctx.add(Fold(logical, f"int{bits}_g", (n, k), (1, g), tuple(sources),
                     _gptq_build(ctx, prefix, bits, g, n, k, version == "gptq", has_g_idx)))


def _gptq_build(ctx: PlanContext, prefix: str, bits: int, g: int, n: int, k: int, v1: bool,
                has_g_idx: bool) -> Callable[[Reader], QuantizedTensor]:
    def build(read: Reader) -> QuantizedTensor:
        q = unpack_words(read(prefix + "qweight").t(), bits)  # [N, K]: words run along K
        zeros = unpack_words(read(prefix + "qzeros"), bits).t()  # [N, K/g]
        if v1:  # GPTQ v1 stores z - 1 (dequantizes s * (q - (z + 1)))
            if bits == 8 and (zeros == 255).any():
                raise ctx.error(prefix + "qzeros", "a GPTQ v1 zero point of 255 + 1 does not fit 8 bits; "
                                                   "save the checkpoint as gptq_v2")
            zeros = zeros + 1
        scales = finite_scale(ctx, prefix + "scales", read(prefix + "scales").float()).t()  # [N, K/g]
        perm = group_perm(ctx, prefix + "g_idx", read(prefix + "g_idx"), k, g) if has_g_idx else None
        return int_weight(q, scales, zeros, bits, g, perm)

    return build


def plan_awq(ctx: PlanContext) -> None:
    """``quant_method: awq`` (``gemm``): every ``X.qweight`` with ``X.qzeros`` and ``X.scales`` -> ``X.weight``."""
    q = ctx.qconfig
    check_keys(ctx, "quant_method 'awq'", q, _AWQ_KEYS)
    bits, group = _bits_group(ctx, (4,))
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version != "gemm":
        raise ctx.config_error(f"version {version!r} is not supported; supported: gemm")
    has_zeros = flag(ctx, "", q, "zero_point", True)
    for prefix, n, k in _int_modules(ctx, "AWQ", lambda e: e.shape[0], lambda e: e.shape[1] * 8):
        qweight = prefix + "qweight"
        g = k if group == -1 else group
        if k % g:
            raise ctx.error(qweight, f"group size {g} does not divide K = {k}")
        ctx.need(prefix + "scales", qweight, "scales")
        ctx.expect(prefix + "scales", FLOAT_SCALE_DTYPES, (k // g, n), "scales")
        sources = [qweight, prefix + "scales"]
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


def _awq_build(ctx: PlanContext, prefix: str, g: int, n: int, k: int,
               has_zeros: bool) -> Callable[[Reader], QuantizedTensor]:
    def build(read: Reader) -> QuantizedTensor:
        order = _awq_columns(n)
        q = unpack_words(read(prefix + "qweight"), 4)[:, order].t()  # [N, K]
        if has_zeros:
            zeros = unpack_words(read(prefix + "qzeros"), 4)[:, order].t()  # [N, K/g]
        else:
            zeros = torch.full((n, k // g), 8, dtype=torch.uint8)
        scales = finite_scale(ctx, prefix + "scales", read(prefix + "scales").float()).t()  # [N, K/g]
        return int_weight(q, scales, zeros, 4, g, None)

    return build
