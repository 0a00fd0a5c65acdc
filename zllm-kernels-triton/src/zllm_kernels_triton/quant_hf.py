"""``linear`` for the HF checkpoints' quantized formats (``fp8_e4m3``, ``int4_g``, ``int8_g``,
``mxfp4``, ``nvfp4``): f32 activations times a weight decoded inside the matmul.

Dimension legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``g`` columns per scale
group (``bk`` for FP8 blocks, 32 for MXFP4, 16 for NVFP4), ``bn`` rows per FP8 scale block.

Kernel layouts (``zllm.weights.formats``; every part contiguous, stays as loaded):

- ``fp8_e4m3``: ``qweight`` uint8 ``[N, K]`` E4M3FN bits, ``scale`` f32 ``[ceil(N/bn), ceil(K/bk)]``;
  ``w = e4m3(q) * scale[n // bn, k // bk]``.
- ``int4_g`` / ``int8_g``: ``qweight`` uint8 ``[N, K/2]`` (low nibble = even column) or ``[N, K]``,
  ``scales`` f32 and ``zeros`` uint8 ``[N, K/g]``; ``w = scales * (q - zeros)``; with act-order
  ``perm`` the kernel reads ``x[:, perm]`` (``x @ W^T = x[:, perm] @ W_stored^T``).
- ``mxfp4``: ``qweight`` uint8 ``[N, K/2]``, ``scales`` uint8 ``[N, K/32]`` E8M0; ``w = e2m1 * 2^(s - 127)``.
- ``nvfp4``: ``qweight`` uint8 ``[N, K/2]``, ``scales`` uint8 ``[N, K/16]`` E4M3FN bits,
  ``global_scale`` f32 0-d; ``w = e2m1 * (e4m3(s) * global_scale)``.

Each program loads the bytes of its ``[BLOCK_N, BLOCK_K]`` weight tile and their scales
(every element reads its own group's scale: the repeated loads hit the same cache lines),
forms the f32 tile — one rounding of quant times scale, as the reference ``zllm.domain.quant_hf``
— and accumulates ``x @ w^T`` with ``tl.dot`` in f32. The tile decode is one ``@triton.jit``
function, :func:`quant_weight_tile`, which the fused MoE (:mod:`.moe`) calls on one expert of
a stack ``[E, N, K]`` (every part with the expert first; NVFP4's ``global_scale`` ``[E]``).

Decoding, exact, from the bits (no ``exp2``, whose GPU approximation need not be exact): E2M1
(``m = code & 7``: ``m / 2`` below 2, else the f32 with exponent ``(m >> 1) - 1`` and mantissa
bit ``m & 1``; bit 3 the sign); E8M0 ``s`` as the f32 bits ``s << 23`` (``s = 0``: 2^-127, the
f32 subnormal ``0x00400000``; 255: inf, as the reference); E4M3FN either by rebiasing its
exponent into f32 bits (subnormals ``m * 2^-9``, ``0x7f``/``0xff`` NaN) or, where
:attr:`Tuning.fp8_convert` declares the device converts E4M3FN itself (``"e4m3fn"``: CUDA from
sm_89), by bitcasting to ``tl.float8e4nv``. ROCm's native FP8 on CDNA3
is E4M3FNUZ (exponent bias 8, no negative zero, NaN at 0x80), a different format from the
checkpoints' E4M3FN: it declares ``"bits"``.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor
from zllm_kernels_triton.quant_matmul import check_linear_args, linear_output
from zllm_kernels_triton.tuning import Tuning

#: format -> constexpr ``FMT`` of :func:`quant_weight_tile`'s decode branch; the keys are
#: :data:`zllm_kernels_triton.table.HF_FORMATS`, the variants the table registers.
FORMAT_CODES = {"fp8_e4m3": 0, "int4_g": 1, "int8_g": 2, "mxfp4": 3, "nvfp4": 4}


@triton.jit
def _e4m3(b, NATIVE: tl.constexpr):
    """E4M3FN bytes (uint8 tile) -> f32, exact."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    e = ((b >> 3) & 15).to(tl.int32)
    m = (b & 7).to(tl.int32)
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # f32 bits: bias 7 -> 127
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32 tile, 0..15) -> f32."""
    m = code & 7
    normal = ((((m >> 1) + 126) << 23) | ((m & 1) << 22)).to(tl.float32, bitcast=True)  # f32 bits: bias 1 -> 127
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def quant_weight_tile(q_ptr, s_ptr, z_ptr, global_scale, rows, ks, mask, stride_qn, stride_sn, BN, G,
                      FMT: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """f32 tile ``w[rows, ks]`` of a weight in format :data:`FORMAT_CODES` ``FMT`` (module doc).

    ``q_ptr``, ``s_ptr``, ``z_ptr``: the ``qweight``, scales (``scale`` / ``scales``) and
    ``zeros`` of one 2-D weight (an expert's: the caller offsets them), each with a contiguous
    last dim; the zero points share the scales' layout and strides. ``global_scale``: NVFP4's
    f32 global scale (ignored otherwise). ``rows`` int64 ``[BLOCK_N, 1]``, ``ks`` ``[BLOCK_K]``
    logical (stored) columns, ``mask`` ``[BLOCK_N, BLOCK_K]``; masked elements are 0.
    ``BN``, ``G``: the rows and columns one scale covers.
    """
    group = (ks // G)[None, :]
    if FMT == 0:  # fp8_e4m3
        b = tl.load(q_ptr + rows * stride_qn + ks[None, :], mask=mask, other=0)
        s = tl.load(s_ptr + (rows // BN) * stride_sn + group, mask=mask, other=0.0)
        w = _e4m3(b, FP8_NATIVE) * s
    elif FMT == 2:  # int8_g
        qv = tl.load(q_ptr + rows * stride_qn + ks[None, :], mask=mask, other=0).to(tl.int32)
        z = tl.load(z_ptr + rows * stride_sn + group, mask=mask, other=0).to(tl.int32)
        w = tl.load(s_ptr + rows * stride_sn + group, mask=mask, other=0.0) * (qv - z).to(tl.float32)
    else:  # nibbles: low = even column
        byte = tl.load(q_ptr + rows * stride_qn + (ks // 2)[None, :], mask=mask, other=0).to(tl.int32)
        code = (byte >> ((ks % 2) * 4)[None, :]) & 15
        if FMT == 1:  # int4_g
            z = tl.load(z_ptr + rows * stride_sn + group, mask=mask, other=0).to(tl.int32)
            w = tl.load(s_ptr + rows * stride_sn + group, mask=mask, other=0.0) * (code - z).to(tl.float32)
        elif FMT == 3:  # mxfp4: E8M0 scale as f32 bits
            e = tl.load(s_ptr + rows * stride_sn + group, mask=mask, other=127).to(tl.int32)
            scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
            w = _e2m1(code) * scale
        else:  # nvfp4: the block scale formed first, as the reference
            sb = tl.load(s_ptr + rows * stride_sn + group, mask=mask, other=0)
            w = _e2m1(code) * (_e4m3(sb, FP8_NATIVE) * global_scale)
    return tl.where(mask, w, 0.0)


@triton.jit
def _quant_linear_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, global_scale,
    T, N, K, stride_xt, stride_qn, stride_sn, BN, G,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, FP8_NATIVE: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < T
    col_mask = cols < N
    n64 = cols.to(tl.int64)[:, None]  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xk = ks
        if HAS_PERM:
            xk = tl.load(perm_ptr + ks, mask=k_mask, other=0)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + xk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = quant_weight_tile(q_ptr, s_ptr, z_ptr, global_scale, n64, ks, col_mask[:, None] & k_mask[None, :],
                              stride_qn, stride_sn, BN, G, FMT, FP8_NATIVE)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


@attrs.frozen
class QuantOperand:
    """A weight of :data:`FORMAT_CODES` as a kernel reads it: its parts with a contiguous
    layout (copied only when they were not), dummies where the format has no such part.

    Attributes:
        code: the constexpr ``FMT`` of :func:`quant_weight_tile`.
        qweight: uint8 ``[*lead, N, K or K/2]``.
        scales: f32 ``[*lead, ceil(N/bn), ceil(K/bk)]`` (FP8) or ``[*lead, N, K/g]`` (f32 for
            int groups, uint8 E8M0/E4M3 bits for MXFP4/NVFP4).
        zeros: uint8, the layout of ``scales`` (int groups), else ``qweight`` (never read).
        perm: int64 ``[*lead, K]`` (act-order), else None.
        global_scale: f32 ``[*lead]`` (NVFP4), else None.
        block: ``(bn, bk)``: rows and columns one scale covers.
    """

    code: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    global_scale: torch.Tensor | None
    block: tuple[int, int]


def quant_operand(weight: QuantizedTensor) -> QuantOperand:
    """``weight``'s :class:`QuantOperand`. Raises AssertionError for a format outside
    :data:`FORMAT_CODES`."""
    assert weight.fmt in FORMAT_CODES, (weight.fmt, sorted(FORMAT_CODES))
    parts = {name: t if t.is_contiguous() else t.contiguous() for name, t in weight.parts.items()}
    q = parts["qweight"]
    return QuantOperand(FORMAT_CODES[weight.fmt], q, parts["scale" if weight.fmt == "fp8_e4m3" else "scales"],
                        parts.get("zeros", q), parts.get("perm"), parts.get("global_scale"), weight.block_shape)


def linear_quant_hf(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None, *,
                    tuning: Tuning = Tuning()) -> torch.Tensor:
    """``x @ W^T + b`` for a 2-D ``weight`` ``[N, K]`` of :data:`FORMAT_CODES` (module doc).

    ``x`` f32 ``[T, K]`` (row-strided views allowed), ``bias`` f32 ``[N]`` or None -> f32 ``[T, N]``.
    Raises AssertionError on a format, shape, dtype or device mismatch.
    """
    assert isinstance(weight, QuantizedTensor) and weight.fmt in FORMAT_CODES and len(weight.shape) == 2, weight
    n, k = check_linear_args(x, weight, bias)
    w = quant_operand(weight)
    assert w.qweight.device == x.device and (bias is None or bias.device == x.device), (w.qweight.device, x.device)
    bn, g = w.block
    global_scale = float(w.global_scale) if w.global_scale is not None else 1.0
    x, out, block_m, grid = linear_output(x, n, tuning)  # out f32 [T, N]
    if out.numel() == 0:
        return out
    t = x.shape[0]
    _quant_linear_kernel[grid](
        x, w.qweight, w.scales, w.zeros, w.perm if w.perm is not None else w.qweight,
        bias if bias is not None else out, out, global_scale,
        t, n, k, x.stride(0), w.qweight.stride(0), w.scales.stride(0), bn, g,
        FMT=w.code, HAS_BIAS=bias is not None, HAS_PERM=w.perm is not None,
        FP8_NATIVE=tuning.fp8_convert == "e4m3fn", PRECISION=tuning.dot_precision,
        BLOCK_M=block_m, BLOCK_N=tuning.linear_block_n, BLOCK_K=tuning.linear_block_k,
        num_warps=tuning.linear_num_warps, num_stages=tuning.linear_num_stages,
    )
    return out
