/* Native GEMV kernels for decode steps: y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y f32.
 *
 * Batch-1 decode reads every weight once per token, so a GEMV is bound by memory bandwidth:
 * each kernel streams the weight once, keeps it in its storage format (f32, bf16, f16, GGUF
 * Q8_0 / Q4_0 blocks), converts it to f32 in registers and accumulates in f32 with AVX2 FMA.
 * Block layouts follow ggml's ggml-common.h (Q8_0: f16 d + 32 int8, w = d * q; Q4_0: f16 d +
 * 16 bytes, byte j = weight j in its low nibble and weight j + 16 in its high nibble,
 * w = d * (q - 8)).
 *
 * Numerics: every output element y[t, n] is reduced in one fixed order that depends only on
 * the format and K (never on T, N, the row's position, the thread split or the other rows):
 *   dense: four 8-lane accumulators over chunks of 32 in-features (accumulator i takes
 *          in-features k with k % 32 in [8i, 8i + 8)), the last 0-3 whole chunks of 8 into
 *          accumulators 0, 1, 2, then (a0 + a2) + (a1 + a3), a fixed horizontal sum, the
 *          K % 8 tail one fused multiply-add at a time, then + bias;
 *   Q8_0 / Q4_0: per 32-weight block an 8-lane sum of q * x over its four chunks of 8,
 *          scaled by the block's d into one of two 8-lane accumulators (even / odd blocks;
 *          one FMA), then a0 + a1, the horizontal sum and + bias.
 * So a row of y is bit-identical whatever else is in the batch (batch-invariant).
 *
 * Order: one weight row at a time, for every token, so each thread streams one contiguous
 * range of the weight front to back (what the hardware prefetchers follow best; interleaving
 * rows makes many short streams, measured 10-40% slower from DRAM). Up to TOKENS_MAX tokens
 * share one conversion of the weights; the row stays in L1/L2 for the next tokens.
 *
 * Threads: OpenMP, with the caller's thread count (torch's). The library is loaded after
 * torch, so it binds to the libgomp torch already loaded: one thread pool for both, and no
 * second set of spinning threads competing for the cores. The rows are cut into work items
 * of at most about CHUNK_BYTES of weights, the same number of items for every thread and the
 * same number of rows for every item, and the items into one contiguous region per thread. A
 * thread takes the items of its own region front to back (one stream), then helps with the
 * others' remaining items, so a thread that the OS deschedules on a busy machine delays
 * only the item it holds instead of its whole share.
 */
#include "common.h"

#define TOKENS_MAX 2              /* tokens sharing one conversion of a weight row */
#define CHUNK_BYTES (64 << 10)    /* weight bytes per work item of the thread split */
#define PREFETCH_BYTES 512

/* Prefetch the cache lines PREFETCH_BYTES ahead of the `bytes` at p: the GEMV loops retire
 * few bytes per instruction (bf16, Q8_0), so the out-of-order window alone keeps too few
 * cache misses in flight; 512 bytes ahead measured 3-8% faster from DRAM than none, and
 * more than 1 KB no better. */
#define PREFETCH(p, bytes)                                                                     \
    for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                                           \
        _mm_prefetch((const char *)(p) + PREFETCH_BYTES + pf_, _MM_HINT_T0)

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
        PREFETCH(w + j, 32 * sizeof(WT));                                                       \
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

/* ---- block-quantized weights (32 per block) ---- */

/* A block's 32 quantized weights as four 8-lane f32 vectors, in order. */
INLINE void block_q8_0(const uint8_t *b, __m256 q[4]) {
    const uint8_t *qs = b + 2;
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
}
INLINE void block_q4_0(const uint8_t *b, __m256 q[4]) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 2));
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m), eight);                     /* weights 0..15 */
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), eight);  /* weights 16..31 */
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

INLINE float block_d(const uint8_t *b) { return _cvtsh_ss((uint16_t)(b[0] | b[1] << 8)); }

/* As DENSE_DOT, block by block. */
#define QUANT_DOT(NAME, BLOCK_BYTES)                                                           \
INLINE void dot_##NAME(const uint8_t *w, const float *x, int64_t xs, const float *bias, float *y, \
                       int64_t ldy, int64_t k, const int TT) {                                  \
    __m256 a[TOKENS_MAX][2];                                                                    \
    for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();                       \
    const int64_t nb = k / 32;                                                                  \
    for (int64_t b = 0; b < nb; b += 2)                                                         \
        for (int h = 0; h < 2; h++) { /* even block -> a[t][0], odd -> a[t][1] */              \
            if (b + h >= nb) break;                                                             \
            const uint8_t *blk = w + (b + h) * (BLOCK_BYTES);                                   \
            PREFETCH(blk, BLOCK_BYTES);                                                         \
            __m256 q[4];                                                                        \
            block_##NAME(blk, q);                                                               \
            const __m256 d = _mm256_set1_ps(block_d(blk));                                      \
            for (int t = 0; t < TT; t++) {                                                      \
                const float *xb = x + t * xs + (b + h) * 32;                                    \
                __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));                            \
                s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);                          \
                s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);                         \
                s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);                         \
                a[t][h] = _mm256_fmadd_ps(d, s, a[t][h]);                                       \
            }                                                                                   \
        }                                                                                       \
    for (int t = 0; t < TT; t++) {                                                              \
        const float s = hsum(_mm256_add_ps(a[t][0], a[t][1]));                                  \
        y[t * ldy] = bias ? s + *bias : s;                                                      \
    }                                                                                           \
}

QUANT_DOT(q8_0, 34)
QUANT_DOT(q4_0, 18)

/* ---- rows [r0, r1) for all T tokens: pairs of tokens, then a last single one ---- */

#define ROWS(NAME, WT)                                                                          \
static void rows_##NAME(const WT *w, int64_t ws, const float *x, int64_t xs, const float *bias, \
                        float *y, int64_t t_total, int64_t n, int64_t k, int64_t r0, int64_t r1) { \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        const WT *wr = w + r * ws;                                                              \
        const float *br = bias ? bias + r : 0;                                                  \
        int64_t t = 0;                                                                          \
        for (; t + 2 <= t_total; t += 2) dot_##NAME(wr, x + t * xs, xs, br, y + t * n + r, n, k, 2); \
        if (t < t_total) dot_##NAME(wr, x + t * xs, xs, br, y + t * n + r, n, k, 1);            \
    }                                                                                           \
}

ROWS(f32, float)
ROWS(bf16, uint16_t)
ROWS(f16, uint16_t)
ROWS(q8_0, uint8_t)
ROWS(q4_0, uint8_t)

/* ---- entry points ---- */

/* zllm_gemv_<format>: w [N, K] with row stride ws (elements; bytes for the block formats),
 * x [T, K] with row stride xs (elements), bias [N] or NULL, y [T, N] contiguous; threads: at
 * most this many OpenMP threads (fewer for a small weight: one per work item at most). */
#define GEMV_ENTRY(NAME, WT, ROW_BYTES)                                                        \
void zllm_gemv_##NAME(const WT *w, int64_t ws, const float *x, int64_t xs, const float *bias,   \
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {                 \
    if (n <= 0 || t <= 0) return;                                                               \
    const int64_t row_bytes = (ROW_BYTES) > 0 ? (ROW_BYTES) : 1;                                \
    int64_t items = (n * row_bytes + CHUNK_BYTES - 1) / CHUNK_BYTES;                            \
    items = items < n ? (items > 1 ? items : 1) : n;                                            \
    int nth = threads < items ? threads : (int)items;                                           \
    nth = nth < MAX_THREADS ? (nth > 1 ? nth : 1) : MAX_THREADS;                                \
    /* as many items per thread for every thread, then equal rows per item: a weight of a  \
     * few items (small models) is split evenly instead of one full item and one stub */   \
    items = (items + nth - 1) / nth * nth;                                                      \
    const int64_t rows = (n + items - 1) / items;                                               \
    items = (n + rows - 1) / rows;                                                              \
    if (nth <= 1) {                                                                             \
        rows_##NAME(w, ws, x, xs, bias, y, t, n, k, 0, n);                                      \
        return;                                                                                 \
    }                                                                                           \
    /* region i = items [i * per, (i + 1) * per): its own thread's stream, front to back */   \
    int64_t next[MAX_THREADS];                                                                  \
    const int64_t per = (items + nth - 1) / nth;                                                \
    for (int i = 0; i < nth; i++) next[i] = i * per;                                            \
    _Pragma("omp parallel num_threads(nth)")                                                    \
    {                                                                                           \
        const int id = omp_get_thread_num(); /* a smaller team still visits every region */ \
        for (int v = 0; v < nth; v++) { /* own region, then help with the others' */             \
            const int region = (id + v) % nth;                                                  \
            const int64_t end = (region + 1) * per < items ? (region + 1) * per : items;        \
            for (;;) {                                                                          \
                const int64_t c = __atomic_fetch_add(&next[region], 1, __ATOMIC_RELAXED);      \
                if (c >= end) break;                                                            \
                const int64_t r0 = c * rows, r1 = r0 + rows < n ? r0 + rows : n;                \
                rows_##NAME(w, ws, x, xs, bias, y, t, n, k, r0, r1);                            \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

GEMV_ENTRY(f32, float, k * 4)
GEMV_ENTRY(bf16, uint16_t, k * 2)
GEMV_ENTRY(f16, uint16_t, k * 2)
GEMV_ENTRY(q8_0, uint8_t, k / 32 * 34)
GEMV_ENTRY(q4_0, uint8_t, k / 32 * 18)
