/* Native GEMV kernels for decode steps: y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y f32.
 *
 * Batch-1 decode reads every weight once per token, so a GEMV is bound by memory bandwidth:
 * each kernel streams the weight once and keeps it in its storage format (f32, bf16, f16,
 * GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks). Dense weights are converted to f32 in
 * registers and accumulated in f32 with AVX2 FMA. Block layouts follow ggml's ggml-common.h
 * (Q8_0: f16 d + 32 int8, w = d * q; Q4_0: f16 d + 16 bytes, byte j = weight j in its low
 * nibble and weight j + 16 in its high nibble, w = d * (q - 8); Q4_1: f16 d + f16 m + the
 * Q4_0 nibbles, w = d * q + m; Q5_0: f16 d + a little-endian uint32 qh whose bit i is bit 4
 * of weight i + the Q4_0 nibbles as the low 4 bits, w = d * (q - 16); Q5_1: f16 d + f16 m +
 * qh + nibbles, w = d * q + m). The GGUF k-quants' row kernels (Q2_K .. Q6_K) are in
 * kquant_gemv.c, under this file's contract.
 *
 * The block formats take integer dot products: converting every int8 / nibble to f32 made the loop
 * instruction-bound (~12 cycles a Q8_0 block, 8.4 GB/s on one core). Instead x is quantized
 * once per call to int16 per block of 32 in-features b: s_b = max|x_b| / 32767 and
 * q_i = round(x_i / s_b) (to nearest even, |q_i| <= 32767; s_b = 0 and q = 0 for a block of
 * zeros or one whose scale underflows to 0; s_b = NaN for a block holding a NaN or an
 * infinity, so every output of that token is NaN). Per weight block the weights are widened
 * to int16 (Q4_0: nibble - 8; Q5_0: q - 16; Q4_1 / Q5_1: q) and multiplied with
 * _mm256_madd_epi16: the block's 32 products land exactly in 8 int32 lanes (4 products a
 * lane, |lane| <= 4 * 128 * 32767 < 2^24, so also exact as f32), which are converted to f32
 * and scaled by d_w * s_b (one FMA). Q4_1 / Q5_1 add m_w * s_b times the block's integer sum
 * of the quantized x (8 exact int32 lanes of sum(q_x), a second FMA): the exact product of
 * w = d_w q + m_w with the quantized x, as for the other formats.
 *
 * Numerics: dense formats: f32 products of the exactly converted weights, only the summation
 * order differs from the f32 reference (~1e-6 relative). Block formats: against the exact
 * product with the dequantized weights w,
 *     |y - y_ref| <= sum over blocks b of (s_b / 2) * sum_(i in b) |w_i|   (plus f32 rounding),
 * since |x_i - s_b q_i| <= s_b / 2; the f32 rounding is that of x_i / s_b (2^-24 |x_i|), of
 * d_w * s_b, and of the f32 sum over the K / 32 blocks (and, where d_w * s_b is subnormal,
 * 2^-150 of the block's integer sum). Q4_1 / Q5_1 round the d_w and m_w parts separately,
 * so their rounding is relative to sum (|d_w q| + |m_w|) |x| rather than sum |w| |x|, and the
 * f32 rounding of w = d_w q + m_w in the reference adds 2^-24 |w| |x|. For x of similar
 * magnitudes within a block that is about 1e-5 relative (llama.cpp's int8 activations: ~1e-3).
 *
 * Order: every output element y[t, n] is reduced in one fixed order that depends only on
 * the format and K (never on T, N, the row's position, the thread split or the other rows):
 *   dense: four 8-lane accumulators over chunks of 32 in-features (accumulator i takes
 *          in-features k with k % 32 in [8i, 8i + 8)), the last 0-3 whole chunks of 8 into
 *          accumulators 0, 1, 2, then (a0 + a2) + (a1 + a3), a fixed horizontal sum, the
 *          K % 8 tail one fused multiply-add at a time, then + bias;
 *   block formats: per 32-weight block the 8 exact int32 lanes above, converted and scaled
 *          by d_w * s_b into one of two 8-lane accumulators (even / odd blocks; one FMA;
 *          Q4_1 / Q5_1 then the m_w * s_b FMA into the same accumulator), then a0 + a1, the
 *          horizontal sum and + bias; x's quantization depends only on the token's own row.
 * So a row of y is bit-identical whatever else is in the batch (batch-invariant).
 *
 * Order: one weight row at a time, for every token, so each thread streams one contiguous
 * range of the weight front to back (what the hardware prefetchers follow best; interleaving
 * rows makes many short streams, measured 10-40% slower from DRAM). Up to TOKENS_MAX tokens
 * (block formats: QUANT_TOKENS_MAX) share one conversion of the weights; the row stays in
 * L1/L2 for the next tokens. The
 * quantized x (T x K int16 + T x K / 32 scales) is written once per call before the rows,
 * split over the threads, on the stack when small and from malloc otherwise.
 *
 * Threads: OpenMP, with the caller's thread count (torch's). The library is loaded after
 * torch, so it binds to the libgomp torch already loaded: one thread pool for both, and no
 * second set of spinning threads competing for the cores. The rows are cut into work items
 * of at most about CHUNK_BYTES of weights, the same number of items for every thread and the
 * same number of rows for every item, and the items into one contiguous region per thread. A
 * thread takes the items of its own region front to back (one stream), then helps with the
 * others' remaining items, so a thread that the OS deschedules on a busy machine delays
 * only the item it holds instead of its whole share. A call whose weight bytes times tokens
 * are under GEMV_PARALLEL_MIN_WORK (common.h) runs on the calling thread alone.
 */
#include "common.h"
#include "gemv.h"
#include "isa.h"

#include <stdlib.h>
#include <string.h>

#define TOKENS_MAX 2              /* tokens sharing one conversion of a weight row */
/* Block formats: tokens sharing one decode of a weight block; their 8 accumulators, the weights
 * and the temporaries fit the 16 AVX2 vector registers (the dense formats' 4 accumulators a
 * token would not). A MoE decode step of 16 tokens gives each selected expert 2-4 (moe.c). */
#define QUANT_TOKENS_MAX 4
#define CHUNK_BYTES (64 << 10)    /* weight bytes per work item of the thread split */
#define PREFETCH_BYTES 512        /* dense formats */
#define QUANT_PREFETCH_BYTES 2048 /* block formats */

/* Prefetch the cache lines `ahead` bytes after the `bytes` at p: the GEMV loops retire few
 * bytes per instruction (bf16, Q8_0, Q4_0), so the out-of-order window alone keeps too few
 * cache misses in flight. Dense: 512 bytes ahead measured 3-8% faster from DRAM than none,
 * and more than 1 KB no better. Q8_0 / Q4_0 (34 / 18 bytes a block): 2 KB ahead measured
 * 5-15% faster than 512 bytes (one thread), 4 KB no better. */
#define PREFETCH(p, ahead, bytes)                                                              \
    for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                                           \
        _mm_prefetch((const char *)(p) + (ahead) + pf_, _MM_HINT_T0)

/* One weight row (w) times TT tokens of x (row stride xs) -> y[t * ldy]; TT is a constant at
 * each call, so the accumulators stay in registers. */
#define DENSE_DOT(NAME, WT)                                                                    \
INLINE void dot_##NAME(const WT *w, const float *x, int64_t xs, const float *bias, float *y,    \
                       int64_t ldy, int64_t k, const int TT) {                                  \
    __m256 a[TOKENS_MAX][4];                                                                    \
    for (int t = 0; t < TT; t++)                                                                \
        for (int i = 0; i < 4; i++) a[t][i] = _mm256_setzero_ps();                              \
    int64_t j = 0;                                                                              \
    for (; j + 32 <= k; j += 32) {                                                              \
        PREFETCH(w + j, PREFETCH_BYTES, 32 * sizeof(WT));                                       \
        __m256 wv[4];                                                                           \
        for (int i = 0; i < 4; i++) wv[i] = load8_##NAME(w + j + 8 * i);                        \
        for (int t = 0; t < TT; t++)                                                            \
            for (int i = 0; i < 4; i++)                                                         \
                a[t][i] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(x + t * xs + j + 8 * i), a[t][i]); \
    }                                                                                           \
    for (int i = 0; i < 3; i++) { /* constant indices keep a[][] in registers */               \
        if (j + 8 > k) break;                                                                   \
        const __m256 wv = load8_##NAME(w + j);                                                  \
        for (int t = 0; t < TT; t++)                                                            \
            a[t][i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * xs + j), a[t][i]);            \
        j += 8;                                                                                 \
    }                                                                                           \
    for (int t = 0; t < TT; t++) {                                                              \
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][2]), _mm256_add_ps(a[t][1], a[t][3]))); \
        for (int64_t i = j; i < k; i++) s = fmaf(load1_##NAME(w + i), x[t * xs + i], s);       \
        y[t * ldy] = bias ? s + *bias : s;                                                      \
    }                                                                                           \
}

DENSE_DOT(f32, float)
DENSE_DOT(bf16, uint16_t)
DENSE_DOT(f16, uint16_t)

/* ---- block-quantized weights (32 per block), int16 activations ---- */

INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* One activation block: 32 values of x -> q (int16, q = round(x / s) to nearest even, the
 * MXCSR default; |q| <= 32767) and the scale s = max|x| / 32767. A block of zeros, or one
 * whose max|x| is so small that s underflows to 0, gets s = 0 and q = 0; a block holding a
 * NaN or an infinity gets s = NaN and q = 0 (so every output it touches is NaN). */
static void quantize_block(const float *x, int16_t *q, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 v[4], m = zero, bad = zero;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v[i], zero)); /* 0, or NaN for NaN / inf */
    }
    const float sb = hmax(m) / 32767.0f + hsum(bad);
    *s = sb;
    __m256i *qb = (__m256i *)q;
    if (!(sb > 0.0f)) { /* zeros, an underflowing scale, or NaN */
        _mm256_storeu_si256(qb, _mm256_setzero_si256());
        _mm256_storeu_si256(qb + 1, _mm256_setzero_si256());
        return;
    }
    const __m256 sv = _mm256_set1_ps(sb);
    for (int i = 0; i < 2; i++) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_div_ps(v[2 * i], sv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_div_ps(v[2 * i + 1], sv));
        /* packs interleaves 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7): restore the order */
        _mm256_storeu_si256(qb + i, _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
}

/* A block's 32 quantized weights as two 16-lane int16 vectors, in order. */
INLINE void block_q8_0(const uint8_t *b, __m256i q[2]) {
    q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
    q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
}
INLINE void block_q4_0(const uint8_t *b, __m256i q[2]) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
    const __m256i eight = _mm256_set1_epi16(8);
    q[0] = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), eight); /* weights 0..15 */
    q[1] = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), eight);                       /* weights 16..31 */
}

/* 16 nibbles (16 bytes at p) as int16 lanes: q[0] = low nibbles (weights 0..15), q[1] = high. */
INLINE void nibbles16(const uint8_t *p, __m256i q[2]) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    q[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(v, 4);
}

/* Bit 4 of 16 weights' q: bit i of `bits` -> int16 lane i, 16 if set, else 0. */
INLINE __m256i high_bit16(uint32_t bits) {
    const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                             (short)0x8000);
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), select), select);
    return _mm256_and_si256(set, _mm256_set1_epi16(16));
}

/* Q5_0 / Q5_1: the nibbles at p + 4 with bit 4 from the little-endian uint32 qh at p. */
INLINE void quants5(const uint8_t *p, __m256i q[2]) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    nibbles16(p + 4, q);
    q[0] = _mm256_or_si256(q[0], high_bit16(qh & 0xFFFF)); /* weights 0..15 */
    q[1] = _mm256_or_si256(q[1], high_bit16(qh >> 16));    /* weights 16..31 */
}

INLINE void block_q4_1(const uint8_t *b, __m256i q[2]) { nibbles16(b + 4, q); }
INLINE void block_q5_0(const uint8_t *b, __m256i q[2]) {
    quants5(b + 2, q);
    q[0] = _mm256_sub_epi16(q[0], _mm256_set1_epi16(16));
    q[1] = _mm256_sub_epi16(q[1], _mm256_set1_epi16(16));
}
INLINE void block_q5_1(const uint8_t *b, __m256i q[2]) { quants5(b + 4, q); }

INLINE float block_d(const uint8_t *b) { return _cvtsh_ss((uint16_t)(b[0] | b[1] << 8)); }
INLINE float block_m(const uint8_t *b) { return _cvtsh_ss((uint16_t)(b[2] | b[3] << 8)); } /* Q4_1 / Q5_1 */

/* One weight row times TT tokens of quantized x (token t: values xq + t * k, scales
 * xs + t * k / 32) -> y[t * ldy]. Per block: the exact integer sum of q_w * q_x in 8 int32
 * lanes (two madds: 4 products a lane, |lane| <= 4 * 128 * 32767 < 2^24, so also exact as
 * f32), converted and scaled by d_w * s_x into one of two 8-lane accumulators (even / odd
 * blocks; one FMA). HAS_MIN (Q4_1 / Q5_1): then m_w * s_x times the block's exact int32 lane
 * sums of q_x (madds with ones) into the same accumulator. The weights are widened once for
 * all TT tokens. */
#define QUANT_DOT(NAME, BLOCK_BYTES, HAS_MIN)                                                  \
INLINE void dot_##NAME(const uint8_t *w, const int16_t *xq, const float *xs, int64_t k,         \
                       const float *bias, float *y, int64_t ldy, const int TT) {                \
    __m256 a[QUANT_TOKENS_MAX][2];                                                              \
    for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();                       \
    const int64_t nb = k / 32;                                                                  \
    for (int64_t b = 0; b < nb; b += 2)                                                         \
        for (int h = 0; h < 2; h++) { /* even block -> a[t][0], odd -> a[t][1] */              \
            if (b + h >= nb) break;                                                             \
            const uint8_t *blk = w + (b + h) * (BLOCK_BYTES);                                   \
            PREFETCH(blk, QUANT_PREFETCH_BYTES, BLOCK_BYTES);                                   \
            __m256i q[2];                                                                       \
            block_##NAME(blk, q);                                                               \
            const float d = block_d(blk), m = (HAS_MIN) ? block_m(blk) : 0.0f;                  \
            for (int t = 0; t < TT; t++) {                                                      \
                const __m256i *xb = (const __m256i *)(xq + t * k + (b + h) * 32);               \
                const __m256i x0 = _mm256_loadu_si256(xb), x1 = _mm256_loadu_si256(xb + 1);     \
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(q[0], x0), _mm256_madd_epi16(q[1], x1)); \
                const float s = xs[t * nb + b + h];                                             \
                a[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * s), a[t][h]); \
                if (HAS_MIN) {                                                                  \
                    const __m256i one = _mm256_set1_epi16(1);                                   \
                    const __m256i sx = _mm256_add_epi32(_mm256_madd_epi16(one, x0), _mm256_madd_epi16(one, x1)); \
                    a[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sx), _mm256_set1_ps(m * s), a[t][h]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    for (int t = 0; t < TT; t++) {                                                              \
        const float s = hsum(_mm256_add_ps(a[t][0], a[t][1]));                                  \
        y[t * ldy] = bias ? s + *bias : s;                                                      \
    }                                                                                           \
}

QUANT_DOT(q8_0, 34, 0)
QUANT_DOT(q4_0, 18, 0)
QUANT_DOT(q4_1, 20, 1)
QUANT_DOT(q5_0, 22, 0)
QUANT_DOT(q5_1, 24, 1)

/* ---- rows [r0, r1) for all T tokens: dense formats pairs of tokens, then a last single one;
 * block formats groups of QUANT_TOKENS_MAX, then the last 1-3 together ---- */


#define DENSE_ROWS(NAME, WT)                                                                    \
static void rows_##NAME(const gemv_args *a, int64_t r0, int64_t r1) {                           \
    const int64_t n = a->n, k = a->k, xs = a->xs;                                               \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        const WT *wr = (const WT *)a->w + r * a->ws;                                            \
        const float *br = a->bias ? a->bias + r : 0;                                            \
        int64_t t = 0;                                                                          \
        for (; t + 2 <= a->t; t += 2) dot_##NAME(wr, a->x + t * xs, xs, br, a->y + t * n + r, n, k, 2); \
        if (t < a->t) dot_##NAME(wr, a->x + t * xs, xs, br, a->y + t * n + r, n, k, 1);         \
    }                                                                                           \
}

#define QUANT_ROWS(NAME) GEMV_QUANT_ROWS(rows_##NAME, dot_##NAME, )

DENSE_ROWS(f32, float)
DENSE_ROWS(bf16, uint16_t)
DENSE_ROWS(f16, uint16_t)
QUANT_ROWS(q8_0)
QUANT_ROWS(q4_0)
QUANT_ROWS(q4_1)
QUANT_ROWS(q5_0)
QUANT_ROWS(q5_1)

/* ---- the thread split, entry points ---- */

/* Quantizes x (block formats: a->xq set) and runs rows(a, r0, r1) over all N rows with at most
 * `threads` threads (file comment: work items, one region per thread). */
static void gemv_split(const gemv_args *a, int64_t row_bytes, int threads, rows_fn rows) {
    const int64_t n = a->n, nb = a->k / 32, xblocks = a->xq ? a->t * nb : 0;
    int64_t items = (n * (row_bytes > 0 ? row_bytes : 1) + CHUNK_BYTES - 1) / CHUNK_BYTES;
    items = items < n ? (items > 1 ? items : 1) : n;
    int nth = gemv_team(threads, items, n * row_bytes * a->t);
    /* as many items per thread for every thread, then equal rows per item: a weight of a
     * few items (small models) is split evenly instead of one full item and one stub */
    items = (items + nth - 1) / nth * nth;
    const int64_t rows_per = (n + items - 1) / items;
    items = (n + rows_per - 1) / rows_per;
    if (nth <= 1) {
        for (int64_t i = 0; i < xblocks; i++) /* block i: token i / nb, in-features 32 * (i % nb) */
            quantize_block(a->x + i / nb * a->xs + i % nb * 32, a->xq + 32 * i, a->xsc + i);
        rows(a, 0, n);
        return;
    }
    /* region i = items [i * per, (i + 1) * per): its own thread's stream, front to back */
    int64_t next[MAX_THREADS];
    const int64_t per = (items + nth - 1) / nth;
    for (int i = 0; i < nth; i++) next[i] = i * per;
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static) /* ends with a barrier: x is quantized before any row */
        for (int64_t i = 0; i < xblocks; i++)
            quantize_block(a->x + i / nb * a->xs + i % nb * 32, a->xq + 32 * i, a->xsc + i);
        const int id = omp_get_thread_num(); /* a smaller team still visits every region */
        for (int v = 0; v < nth; v++) { /* own region, then help with the others' */
            const int region = (id + v) % nth;
            const int64_t end = (region + 1) * per < items ? (region + 1) * per : items;
            for (;;) {
                const int64_t c = __atomic_fetch_add(&next[region], 1, __ATOMIC_RELAXED);
                if (c >= end) break;
                rows(a, c * rows_per, c * rows_per + rows_per < n ? c * rows_per + rows_per : n);
            }
        }
    }
}

/* zllm_gemv_<format>: w [N, K] with row stride ws (elements; bytes for the block formats),
 * x [T, K] with row stride xs (elements), bias [N] or NULL, y [T, N] contiguous; threads: at
 * most this many OpenMP threads (fewer for a small weight: one per work item at most). */
#define DENSE_ENTRY(NAME, WT, ELEM_BYTES)                                                      \
void zllm_gemv_##NAME(const WT *w, int64_t ws, const float *x, int64_t xs, const float *bias,   \
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {                 \
    if (n <= 0 || t <= 0) return;                                                               \
    const gemv_args a = {w, ws, x, xs, 0, 0, bias, y, t, n, k};                                 \
    gemv_split(&a, k * (ELEM_BYTES), threads, rows_##NAME);                                     \
}

DENSE_ENTRY(f32, float, 4)
DENSE_ENTRY(bf16, uint16_t, 2)
DENSE_ENTRY(f16, uint16_t, 2)

/* The quantized x: T x K int16 values then T x K / 32 f32 scales, on the stack up to
 * XQ_STACK_BYTES (T * K up to 7K: every decode step of a small model), else from malloc. */
#define XQ_STACK_BYTES (16 << 10)

void gemv_quantized(const void *w, int64_t ws, const float *x, int64_t xs, const float *bias, float *y,
                    int64_t t, int64_t n, int64_t k, int64_t row_bytes, int threads, rows_fn rows) {
    if (n <= 0 || t <= 0) return;
    const size_t bytes = (size_t)(t * k) * sizeof(int16_t) + (size_t)(t * (k / 32)) * sizeof(float);
    _Alignas(32) unsigned char stack[XQ_STACK_BYTES];
    unsigned char *buf = bytes <= sizeof stack ? stack : malloc(bytes);
    if (!buf) {
        for (int64_t i = 0; i < t * n; i++) y[i] = NAN;
        return;
    }
    const gemv_args a = {w, ws, x, xs, (int16_t *)buf, (float *)(buf + (size_t)(t * k) * sizeof(int16_t)),
                         bias, y, t, n, k};
    gemv_split(&a, row_bytes, threads, rows);
    if (buf != stack) free(buf);
}

/* Block formats (K a multiple of 32). If the quantized x cannot be allocated, y is NaN. */
#define QUANT_ENTRY(NAME, FORMAT, BLOCK_BYTES)                                                 \
void zllm_gemv_##NAME(const uint8_t *w, int64_t ws, const float *x, int64_t xs, const float *bias, \
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {                 \
    gemv_quantized(w, ws, x, xs, bias, y, t, n, k, k / 32 * (BLOCK_BYTES), threads, gemv_rows(FORMAT)); \
}

QUANT_ENTRY(q8_0, GEMV_Q8_0, 34)
QUANT_ENTRY(q4_0, GEMV_Q4_0, 18)
QUANT_ENTRY(q4_1, GEMV_Q4_1, 20)
QUANT_ENTRY(q5_0, GEMV_Q5_0, 22)
QUANT_ENTRY(q5_1, GEMV_Q5_1, 24)

/* ---- for the other kernels (gemv.h) ---- */

rows_fn gemv_rows(int format) {
    static const rows_fn table[GEMV_NFORMATS] = {rows_f32, rows_f16, rows_bf16, rows_q8_0, rows_q4_0,
                                                 rows_q4_1, rows_q5_0, rows_q5_1, gemv_rows_q2_k,
                                                 gemv_rows_q3_k, gemv_rows_q4_k, gemv_rows_q5_k, gemv_rows_q6_k};
    if (format < 0 || format >= GEMV_NFORMATS) return 0;
    const rows_fn wide = native_isa_level >= ISA_AVX512 ? gemv_rows_avx512(format) : 0;
    return wide ? wide : table[format];
}

int gemv_is_block(int format) { return format >= GEMV_Q8_0; }

int64_t gemv_row_bytes(int format, int64_t k) {
    switch (format) {
    case GEMV_F32: return 4 * k;
    case GEMV_F16: case GEMV_BF16: return 2 * k;
    case GEMV_Q8_0: return k / 32 * 34;
    case GEMV_Q4_0: return k / 32 * 18;
    case GEMV_Q4_1: return k / 32 * 20;
    case GEMV_Q5_0: return k / 32 * 22;
    case GEMV_Q5_1: return k / 32 * 24;
    case GEMV_Q2_K: return k / 256 * 84;
    case GEMV_Q3_K: return k / 256 * 110;
    case GEMV_Q4_K: return k / 256 * 144;
    case GEMV_Q5_K: return k / 256 * 176;
    default: return k / 256 * 210; /* Q6_K */
    }
}

void gemv_quantize_rows(const float *x, int64_t xs, int64_t t, int64_t k, int16_t *xq, float *xsc) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t b = 0; b < k / 32; b++) quantize_block(x + i * xs + 32 * b, xq + i * k + 32 * b, xsc + i * (k / 32) + b);
}
