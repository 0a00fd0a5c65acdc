"""One tile of a weight in its stored format, as f32, for the kernels that read dense or Q8_0
weights through the same code (``moe``, ``mla_attention``).

Q8_0 layout (ggml ``ggml/src/ggml-common.h`` ``block_q8_0``, as in :mod:`.quant_matmul`): a
row is blocks of 34 bytes, a little-endian f16 scale ``d`` then 32 int8 ``qs``, and
``w[r, 32 * b + i] = d * qs[i]``. Here every element rebuilds its block's scale from the two
bytes itself, so a tile may start at any column and run along rows or columns alike (the
absorbed MLA query contracts ``kv_b_proj`` over its rows); the repeated scale loads hit the
same cache lines. ``d * qs`` is exact in f32 (8 x 11 significant bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zllm.plugin_api import QuantizedTensor

#: The dtypes a dense weight may have.
DENSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def load_weight_tile(row_ptrs, cols, mask, Q8: tl.constexpr):
    """f32 tile ``w[rows, cols]``: ``row_ptrs`` point at each row's first element (dense:
    f32/f16/bf16 elements; Q8_0: the row's first byte), ``cols`` are logical column indices,
    both broadcast to the tile's shape with ``mask``; masked elements are 0."""
    if Q8:
        block = row_ptrs + (cols // 32) * 34  # first byte (the scale) of each element's block
        qs = tl.load(block + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        d_lo = tl.load(block, mask=mask, other=0).to(tl.uint16)
        d_hi = tl.load(block + 1, mask=mask, other=0).to(tl.uint16)
        d = (d_lo | (d_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        return qs.to(tl.float32) * d
    return tl.load(row_ptrs + cols, mask=mask, other=0.0).to(tl.float32)


def weight_operand(weight: torch.Tensor | QuantizedTensor, what: str) -> tuple[torch.Tensor, bool]:
    """``(tensor, is_q8_0)``: a dense f32/f16/bf16 weight, or a Q8_0 weight's uint8 bytes,
    with a contiguous last dim (copied only if it was not).

    Raises AssertionError naming ``what`` and the format for anything else.
    """
    if isinstance(weight, QuantizedTensor):
        assert weight.fmt == "q8_0", f"{what}: format {weight.fmt!r} (Triton kernels read f32/f16/bf16 and q8_0)"
        data = weight.data
        return (data if data.stride(-1) == 1 else data.contiguous()), True
    assert weight.dtype in DENSE_DTYPES, f"{what}: dtype {weight.dtype} (Triton kernels read f32/f16/bf16 and q8_0)"
    return (weight if weight.stride(-1) == 1 else weight.contiguous()), False

