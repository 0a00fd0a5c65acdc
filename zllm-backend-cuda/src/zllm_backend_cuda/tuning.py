"""Triton launch parameters of the CUDA backend (NVIDIA sm_80 Ampere through sm_90 Hopper).

One warp is 32 threads. Decode is bandwidth-bound: the kernels that stream the KV cache and
the Q8_0 weights use 64-key / 64-column tiles and 4 warps (128 threads), small enough that
many programs stay resident per SM; prefill attention uses 64 x 64 tiles. Pipeline stages
(2-3) overlap the next tile's loads (``cp.async`` on sm_80+) with the current tile's math.
Row-wise kernels (RMSNorm) keep a whole row of up to 4096 features in registers with 8
warps. ``dot_precision`` stays ``ieee``: f32 products on every sm, as the f32 reference
computes them (``tf32x3`` would move the f32 dots onto tensor cores on sm_80+, at a small
accuracy cost; decode, bound by memory, would not gain from it).

=================  ===========  ===========  ======  ==========================================
kernel             tile         warps        stages  why
=================  ===========  ===========  ======  ==========================================
rms_norm           K 4096       8            -       one pass over rows up to 4096 wide
rope               4 heads x    4            -       one token's heads per program
                   64 pairs
silu_mul           1024 cols    4            -       one 4 KiB f32 tile per program
kv write           4 heads      4            -       one token per program
decode attention   64 keys      4            2       KV streaming; 4 blocks of 16 per step
prefill attention  64 x 64      4            2       64 queries x 64 keys per step
linear q8_0        16 x 64 x    4            3       decode is GEMV-like (T <= 16 rows); four
                   128                               Q8_0 blocks per K step
fused moe          16 pairs x   4            3       a decode step pads each selected expert's
                   64 x 128                          pairs to 16 (the smallest MMA M); weights
                                                     streamed 64 rows x 128 in-features a step
mla decode         16 heads x   4            2       one latent row (R + Dr, 576 in DeepSeek)
                   32 rows                           read once per 16 heads; 32 rows keep the
                                                     [32, R] tile within registers
=================  ===========  ===========  ======  ==========================================

The fused MoE and MLA decode tiles follow vLLM's defaults for those kernels and were not
measured on a device yet.
"""

from zllm_kernels_triton import Tuning

CUDA_TUNING = Tuning(
    name="cuda", dot_precision="ieee",
    norm_block_k=4096, norm_num_warps=8, rope_block_h=4, rope_block_pairs=64, rope_num_warps=4,
    silu_block_n=1024, silu_num_warps=4, kv_write_block_h=4, kv_write_num_warps=4,
    decode_block_n=64, decode_num_warps=4, decode_num_stages=2,
    prefill_block_m=64, prefill_block_n=64, prefill_num_warps=4, prefill_num_stages=2,
    linear_block_m=16, linear_block_n=64, linear_block_k=128, linear_num_warps=4, linear_num_stages=3,
    moe_block_m=16, moe_block_n=64, moe_block_k=128, moe_num_warps=4, moe_num_stages=3,
    mla_block_h=16, mla_block_n=32, mla_num_warps=4, mla_num_stages=2,
    fp8_convert="bits",  # sm_80 has no FP8 conversion; "e4m3fn" needs sm_89 and a device check
)
