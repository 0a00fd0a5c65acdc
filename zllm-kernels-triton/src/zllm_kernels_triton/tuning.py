"""Launch parameters of every kernel in this package: one frozen object, chosen by the backend.

The kernels name no device and no model: tile sizes, warps and pipeline stages all come from a
:class:`Tuning`. A backend (CUDA, ROCm) builds one for its hardware and passes it to
:func:`zllm_kernels_triton.kernel_table`; tests pass small tiles so that Triton's CPU
interpreter stays fast. Only shape-bound sizes are derived from the call: a tile over the
head dim ``D`` (or the ``G`` query heads of a GQA group) is the next power of two of that
dim, at least :attr:`Tuning.dot_min`.

``tl.arange`` needs power-of-two lengths and Triton power-of-two warp counts, so every
``block_*`` and ``num_warps`` field must be one. On a GPU, ``tl.dot`` operands need every
tile side >= 16: keep ``dot_min``, ``prefill_block_m``, ``prefill_block_n``,
``decode_block_n``, ``linear_block_m``, ``linear_block_n``, ``linear_block_k``, the
``moe_block_*`` and ``mla_block_*`` fields >= 16 there (the interpreter has no such limit).
"""

from __future__ import annotations

from typing import Any

import attrs

#: ``input_precision`` values of ``tl.dot`` for f32 operands (Triton 3.x): ``ieee`` is exact
#: f32 on every target; ``tf32`` (NVIDIA, AMD CDNA3) rounds operands to a 10-bit mantissa;
#: ``tf32x3`` (NVIDIA) recovers about f32 accuracy from three tf32 products.
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")


def _power_of_two(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
        raise ValueError(f"Tuning.{attribute.name} = {value!r} must be a power of two >= 1")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value > 0):
        raise ValueError(f"Tuning.{attribute.name} = {value!r} must be an int >= 1")


def _q8_0_block_multiple(instance: object, attribute: attrs.Attribute, value: int) -> None:
    _power_of_two(instance, attribute, value)
    if value < 32:
        raise ValueError(f"Tuning.{attribute.name} = {value} must be a multiple of the Q8_0 block (32 weights)")


def _dot_precision(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in DOT_PRECISIONS:
        raise ValueError(f"Tuning.{attribute.name} = {value!r} is not one of {', '.join(DOT_PRECISIONS)}")


#: How the kernels turn E4M3FN bytes into f32 (:attr:`Tuning.fp8_convert`): ``bits`` by integer
#: arithmetic (any device, the interpreter included); ``e4m3fn`` by the device's own FP8
#: conversion (``tl.float8e4nv``; NVIDIA from sm_89).
FP8_CONVERTS = ("bits", "e4m3fn")


def _fp8_convert(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in FP8_CONVERTS:
        raise ValueError(f"Tuning.{attribute.name} = {value!r} is not one of {', '.join(FP8_CONVERTS)}")


def _block(default: int) -> Any:
    """A power-of-two field (tile sizes, warps)."""
    return attrs.field(default=default, validator=_power_of_two)


def _count(default: int) -> Any:
    """A positive count field (pipeline stages)."""
    return attrs.field(default=default, validator=_positive)


@attrs.frozen
class Tuning:
    """Tile sizes and launch settings for every kernel.

    The defaults were measured on an NVIDIA H200 (Triton 3.6); a backend overrides what
    its hardware needs.

    Attributes:
        name: label shown in kernel names (``--explain``), e.g. ``"cuda-sm90"``.
        dot_min: smallest side of a ``tl.dot`` tile; the head-dim tile and the GQA group
            tile of decode are padded (masked) up to it.
        dot_precision: ``tl.dot`` ``input_precision`` of the f32 attention and Q8_0 matmul
            products, one of :data:`DOT_PRECISIONS`. Default ``tf32x3`` (NVIDIA only):
            within 2e-6 of the f32 reference on an H200, and attention ran 25-125x
            faster there than with ``ieee``, which Triton lowers to FMA loops. AMD targets need ``ieee`` (or
            ``tf32`` on CDNA3).
        norm_block_k: RMSNorm columns per chunk; a row longer than this is done in two
            passes over chunks (sum of squares, then scale), a shorter one in registers.
        norm_num_warps: warps per RMSNorm program (one program per row).
        rope_block_h: heads per RoPE program (program per token and head tile).
        rope_block_pairs: rotation pairs per chunk of a head (``D / 2`` pairs in all).
        rope_num_warps: warps per RoPE program.
        silu_block_n: columns per ``silu_mul`` program (program per row and column tile).
        silu_num_warps: warps per ``silu_mul`` program.
        kv_write_block_h: KV heads per KV-cache write program (program per token and head tile).
        kv_write_num_warps: warps per KV-cache write program.
        decode_block_n: keys per step of decode attention (may span cache blocks).
        decode_num_warps, decode_num_stages: decode attention launch settings.
        prefill_block_m: query tokens per prefill attention program.
        prefill_block_n: keys per step of prefill attention.
        prefill_num_warps, prefill_num_stages: prefill attention launch settings.
        linear_block_m, linear_block_n: output tile (tokens x out-features) of the Q8_0
            matmul; fewer tokens than ``linear_block_m`` get a tile of the next power of two
            of ``T`` (at least ``dot_min``), so a decode step does not pad to 64 rows.
        linear_block_k: in-features per step of the Q8_0 matmul, a multiple of 32 (whole
            Q8_0 blocks).
        linear_num_warps, linear_num_stages: Q8_0 matmul launch settings; the per-head
            projections of MLA (``q_nope · W_UK``, the latent sum through ``W_UV``) use the
            same tiles.
        moe_block_m: (token, expert) pairs per block of the fused MoE GEMMs; each expert's
            pairs are padded to a multiple of it, so a decode step pads to it per expert.
        moe_block_n, moe_block_k: output columns and in-features per step of the fused MoE
            GEMMs; ``moe_block_k`` is a multiple of 32 (whole Q8_0 blocks).
        moe_num_warps, moe_num_stages: fused MoE GEMM launch settings.
        mla_block_h: query heads per MLA decode program (heads share every latent row read).
        mla_block_n: cached latent rows per step of MLA decode (may span cache blocks).
        mla_num_warps, mla_num_stages: MLA decode launch settings.
        fp8_convert: how the FP8 weights' E4M3FN bytes become f32, one of
            :data:`FP8_CONVERTS`: declared per device, never guessed (ROCm's native FP8 on
            CDNA3 is E4M3FNUZ, another format). The linear kernels of the HF checkpoints'
            formats (``linear[fp8_e4m3]``, ``linear[nvfp4]``'s scales) use it.
    """

    name: str = "default"
    dot_min: int = _block(16)
    dot_precision: str = attrs.field(default="tf32x3", validator=_dot_precision)
    norm_block_k: int = _block(4096)
    norm_num_warps: int = _block(8)
    rope_block_h: int = _block(4)
    rope_block_pairs: int = _block(64)
    rope_num_warps: int = _block(4)
    silu_block_n: int = _block(1024)
    silu_num_warps: int = _block(4)
    kv_write_block_h: int = _block(4)
    kv_write_num_warps: int = _block(4)
    decode_block_n: int = _block(64)
    decode_num_warps: int = _block(4)
    decode_num_stages: int = _count(2)
    prefill_block_m: int = _block(64)
    prefill_block_n: int = _block(64)
    prefill_num_warps: int = _block(4)
    prefill_num_stages: int = _count(2)
    linear_block_m: int = _block(64)
    linear_block_n: int = _block(32)
    linear_block_k: int = attrs.field(default=128, validator=_q8_0_block_multiple)
    linear_num_warps: int = _block(4)
    linear_num_stages: int = _count(2)
    moe_block_m: int = _block(16)
    moe_block_n: int = _block(64)
    moe_block_k: int = attrs.field(default=64, validator=_q8_0_block_multiple)
    moe_num_warps: int = _block(4)
    moe_num_stages: int = _count(2)
    mla_block_h: int = _block(16)
    mla_block_n: int = _block(32)
    mla_num_warps: int = _block(4)
    mla_num_stages: int = _count(2)
    fp8_convert: str = attrs.field(default="bits", validator=_fp8_convert)
