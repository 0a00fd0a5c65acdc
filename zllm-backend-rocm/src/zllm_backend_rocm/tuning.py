"""Triton launch parameters of the ROCm backend (CDNA gfx90a/gfx94x/gfx95x, RDNA gfx11xx/gfx12xx).

A Triton "warp" on the AMD target is one wavefront: 64 lanes on CDNA (gfx9xx), 32 on RDNA
(gfx11xx/gfx12xx), so a multiple of 64 is whole wavefronts on both. Every tile side spread
over lanes is one: 64 keys per decode step, 64 x 64 prefill tiles, 64 output columns and 64
in-features (two Q8_0 blocks) per Q8_0 matmul step, 64 RoPE pairs, 1024 SiLU columns,
RMSNorm rows of up to 4096 in one pass. The token side of the Q8_0 matmul stays 16, the
smallest MFMA M: a decode step has one token per sequence. RMSNorm runs 4 wavefronts per
row (256 lanes on CDNA, 16 features each at 4096) where CUDA runs 8 warps of 32; the other
kernels keep 4. ``num_stages = 2`` is what AMD recommends for its stream pipeliner (one
tile prefetched); more stages only add LDS pressure. ``dot_precision`` is ``ieee``:
tf32-like modes exist on CDNA3 only. The fused MoE GEMMs take 16 pairs (the smallest MFMA M)
x 64 columns x 64 in-features; MLA decode reads 32 latent rows per step for 16 heads (a
``[32, R + Dr]`` tile, 576 wide in DeepSeek, is what fits the register file at 4 wavefronts).

Chosen from the AMD Triton guidance (ROCm docs, "Optimizing Triton kernels"); not measured
on a device yet.
"""

from zllm_kernels_triton import Tuning

_LANE_TILE = 64  # one CDNA wavefront, two RDNA ones
ROCM_TUNING = Tuning(name="rocm", dot_precision="ieee", norm_num_warps=4, rope_block_pairs=_LANE_TILE,
                     decode_block_n=_LANE_TILE, prefill_block_m=_LANE_TILE, prefill_block_n=_LANE_TILE,
                     linear_block_n=_LANE_TILE, linear_block_k=_LANE_TILE, linear_num_stages=2,
                     moe_block_m=16, moe_block_n=_LANE_TILE, moe_block_k=_LANE_TILE, moe_num_stages=2,
                     mla_block_h=16, mla_block_n=32, mla_num_stages=2,
                     fp8_convert="bits")  # CDNA3's own FP8 is E4M3FNUZ, not the checkpoints' E4M3FN
