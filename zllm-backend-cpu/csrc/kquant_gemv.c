/* Native GEMV row kernels for the GGUF k-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K:
 * y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y f32, W in its super-blocks of 256 weights
 * (K a multiple of 256). They are gemv.c's block-format kernels for another block layout and
 * keep its contract (gemv.c's file comment): x quantized once per call to int16 per block of
 * 32 in-features (s_b = max|x_b| / 32767, gemv.c's quantize_block), each 32-weight block an
 * integer dot product of int16 weights with the int16 x by _mm256_madd_epi16, scaled in f32
 * into one of two 8-lane accumulators (even / odd blocks of 32), then a0 + a1, the fixed
 * horizontal sum and + bias. gemv.h hands the row kernels to moe.c; the entry points run them
 * through gemv.c's thread split (gemv_quantized).
 *
 * Layouts (ggml's ggml-common.h; gguf-py's quants.py dequantizes them, zllm.domain.quant after
 * it): d and dmin are f16; in a super-block, weight i lies in block j = i / 32 and sub-block
 * s = i / 16; "weight 32 j + l" means l in [0, 32).
 *   Q4_K (144 bytes): d, dmin, 12 bytes b of 6-bit scales sc and mins m of the 8 blocks (j < 4:
 *     sc = b[j] & 63, m = b[j + 4] & 63; j >= 4: sc = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4,
 *     m = (b[j + 4] >> 4) | (b[j] >> 6) << 4), 128 bytes qs: weight 64 g + l is the low nibble
 *     of qs[32 g + l], weight 64 g + 32 + l its high nibble; w = (d sc_j) q - dmin m_j.
 *   Q5_K (176): d, dmin, the Q4_K scales, 32 bytes qh, the Q4_K qs as the low 4 bits: bit j of
 *     qh[l] is bit 4 of weight 32 j + l; w = (d sc_j) q - dmin m_j.
 *   Q6_K (210): 128 bytes ql, 64 bytes qh, 16 int8 scales sc_s, d: weight 128 h + 32 g + l
 *     takes its low 4 bits from ql[64 h + 32 (g & 1) + l] (low nibble for g < 2, high for
 *     g >= 2) and its high 2 bits from (qh[32 h + l] >> 2 g) & 3; w = (d sc_s) (q - 32).
 *   Q3_K (110): 32 bytes hmask, 64 bytes qs, 12 bytes b of 6-bit scales, d: weight
 *     128 n + 32 g + l has low 2 bits (qs[32 n + l] >> 2 g) & 3, minus 4 when bit j of
 *     hmask[l] is clear; sc_s = ((b[s % 8] >> 4 (s / 8)) & 15 | ((b[8 + s % 4] >> 2 (s / 4)) & 3)
 *     << 4) - 32; w = (d sc_s) q.
 *   Q2_K (84): 16 scale bytes (low nibble sc_s, high nibble m_s), 64 bytes qs, d, dmin: weight
 *     128 n + 32 g + l is (qs[32 n + l] >> 2 g) & 3; w = (d sc_s) q - (dmin m_s).
 *
 * Products, per block j of 32 weights and token (s_b: the token's scale of that block):
 *   Q4_K / Q5_K: P = sum q_i q_x,i in 8 int32 lanes (4 products a lane, |lane| <= 4 * 31 *
 *     32767 < 2^22: exact, also as f32); a += fl(d sc_j s_b) P (one FMA);
 *   Q6_K / Q3_K / Q2_K: per 16-weight sub-block s (each half of the block) P_s = sum q_i q_x,i
 *     in 8 int32 lanes (2 products a lane, |lane| <= 2 * 32 * 32767 < 2^21: exact, also as
 *     f32); a += fl(d sc_s s_b) P_s, the first half then the second (two FMAs). Folding the
 *     integer scales into the int16 weights instead (one FMA a block, but two vpmullw, and
 *     Q6_K's lanes up to 2^29, no longer exact as f32) measured 8-10% slower at T = 1 and 2-10%
 *     faster at T = 2 and 4 on one core.
 * The mins (Q4_K / Q5_K per block of 32, Q2_K per sub-block of 16): the token's exact integer
 * sum X_g of q_x over each group g depends on no weight, so it is taken once per call of the
 * rows function (x_sums) as xm_g = fl(s_b X_g); per super-block and token the 8 (Q2_K: 16)
 * products dmin m_g * xm_g go into an 8-lane accumulator am lane by lane (one FMA per 8), which
 * is subtracted at the end. Q4_K's mins thus cost one FMA per 256 weights instead of two madds,
 * a convert and an FMA per block (Q4_K measured 1.6x faster on one core).
 * Against the exact product with the dequantized weights the error is gemv.c's bound,
 * sum over blocks b of (s_b / 2) * sum_(i in b) |w_i|, plus f32 rounding; Q4_K / Q5_K / Q2_K
 * round the scale and min parts separately (as gemv.c's Q4_1 / Q5_1), so their rounding is
 * relative to sum (|d sc q| + |dmin m|) |x| rather than sum |w| |x|.
 *
 * Order: per super-block in ascending order, the min products into am, then block j's scaled
 * P into a[j % 2] (Q6_K / Q3_K / Q2_K: P_2j, then P_2j+1); at the end hsum((a0 + a1) - am) + bias. A token's output depends only on its
 * own row of x (its quantization and sums), the weight row, the format and K, whatever T, N,
 * the row's position or the thread split (batch-invariant). Up to TOKENS_MAX tokens share one
 * unpacking of a weight block (the rows functions take tokens in pairs, as gemv.c's).
 */
#include "common.h"
#include "gemv.h"

#include <stdlib.h>
#include <string.h>

#define TOKENS_MAX 2        /* tokens sharing one unpacking of a weight block (gemv.c's) */
#define PREFETCH_AHEAD 2048 /* bytes ahead, gemv.c's QUANT_PREFETCH_BYTES */
#define QK_K 256            /* weights per super-block */

/* One super-block's scales, unpacked once for all its blocks and tokens. */
typedef struct {
    __m256 fd;         /* Q4_K, Q5_K: lane j, the f32 factor d sc_j of block j's P */
    __m256 mn[2];      /* the min factors dmin m, lane j of mn[0] for block j (Q4_K / Q5_K), or
                        * lane s % 8 of mn[s / 8] for sub-block s (Q2_K) */
    __m256 fsub[2];    /* Q6_K, Q3_K, Q2_K: lane s % 8 of fsub[s / 8], the f32 factor d sc_s of sub-block s */
} kq_scales;

INLINE float f16_at(const uint8_t *p) { return _cvtsh_ss((uint16_t)(p[0] | p[1] << 8)); }

INLINE uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 8 bytes (the little-endian uint32 lo, then hi) as f32 lanes, times f. */
INLINE __m256 bytes8_times(uint32_t lo, uint32_t hi, float f) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)hi, (int)lo));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(f)); /* exact: 11 bits times 6 */
}

/* 32 bytes as two 16-lane int16 vectors: bytes 0..15 and 16..31, unsigned or signed. */
INLINE void widen_u8(__m256i v, __m256i q[2]) {
    q[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    q[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
}
INLINE void widen_i8(__m256i v, __m256i q[2]) {
    q[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    q[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The low (high = 0) or high nibbles of 32 bytes, one per byte. */
INLINE __m256i nibbles(__m256i v, int high) {
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

/* The 2-bit field at bits 2 g, 2 g + 1 of each of 32 bytes (the 16-bit shift moves bits across
 * bytes only above bit 8 - 2 g, which the mask drops). */
INLINE __m256i crumbs(__m256i v, int g) { return _mm256_and_si256(_mm256_srli_epi16(v, 2 * g), _mm256_set1_epi8(3)); }

/* `value` in each of 32 bytes whose bit j is set, else 0. */
INLINE __m256i bit_value(__m256i v, int j, char value) {
    const __m256i m = _mm256_set1_epi8((char)(1 << j));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, m), m), _mm256_set1_epi8(value));
}

/* 16 int8 sub-block scales (already minus any offset) times d: lanes 0-7 and 8-15. */
INLINE void sub_factors(__m128i sc, float d, __m256 f[2]) {
    const __m256 dv = _mm256_set1_ps(d); /* exact: an 11-bit significand times 8 bits */
    f[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), dv);
    f[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), dv);
}

/* ---- per format: the super-block's scales, and block j's 32 weights as int16 ---- */

/* Q4_K / Q5_K: d, dmin and the 12 packed scale bytes at sb + 4 (get_scale_min_k4), four
 * bytes per 32-bit operation: scales 0-3 = lo & 63, 4-7 = (hi & 15) | (lo >> 6) << 4; mins
 * 0-3 = mid & 63, 4-7 = (hi >> 4) | (mid >> 6) << 4. */
INLINE void scales_k4(const uint8_t *sb, kq_scales *s) {
    const uint32_t lo = u32_at(sb + 4), mid = u32_at(sb + 8), hi = u32_at(sb + 12);
    s->fd = bytes8_times(lo & 0x3F3F3F3F, (hi & 0x0F0F0F0F) | ((lo >> 2) & 0x30303030), f16_at(sb));
    s->mn[0] = bytes8_times(mid & 0x3F3F3F3F, ((hi >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030), f16_at(sb + 2));
}
#define scales_q4_k scales_k4
#define scales_q5_k scales_k4

INLINE void block_q4_k(const uint8_t *sb, const kq_scales *s, int j, __m256i q[2]) {
    (void)s;
    widen_u8(nibbles(load32(sb + 16 + 32 * (j / 2)), j & 1), q);
}

INLINE void block_q5_k(const uint8_t *sb, const kq_scales *s, int j, __m256i q[2]) {
    (void)s;
    widen_u8(_mm256_or_si256(nibbles(load32(sb + 48 + 32 * (j / 2)), j & 1), bit_value(load32(sb + 16), j, 16)), q);
}

INLINE void scales_q6_k(const uint8_t *sb, kq_scales *s) {
    sub_factors(_mm_loadu_si128((const __m128i *)(sb + 192)), f16_at(sb + 208), s->fsub);
}

INLINE void block_q6_k(const uint8_t *sb, const kq_scales *s, int j, __m256i q[2]) {
    const int h = j / 4, g = j % 4;
    const __m256i lo = nibbles(load32(sb + 64 * h + 32 * (g & 1)), g >= 2);
    const __m256i hi = _mm256_slli_epi16(crumbs(load32(sb + 128 + 32 * h), g), 4); /* <= 48: stays in its byte */
    (void)s;
    widen_i8(_mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)), q);
}

/* Q3_K: the 16 6-bit scales from the 12 bytes at sb + 96, four per 32-bit operation (ggml's
 * dequantize_row_q3_K): scales 4 i .. 4 i + 3 take their low 4 bits from word i % 2 (shifted
 * by 4 for i >= 2) and their high 2 bits from word 2 shifted by 2 i. */
INLINE void scales_q3_k(const uint8_t *sb, kq_scales *s) {
    const uint32_t w0 = u32_at(sb + 96), w1 = u32_at(sb + 100), w2 = u32_at(sb + 104);
    const uint32_t m4 = 0x0F0F0F0F, m2 = 0x03030303;
    const __m128i v = _mm_set_epi32((int)(((w1 >> 4) & m4) | ((w2 >> 6) & m2) << 4),
                                    (int)(((w0 >> 4) & m4) | ((w2 >> 4) & m2) << 4),
                                    (int)((w1 & m4) | ((w2 >> 2) & m2) << 4), (int)((w0 & m4) | (w2 & m2) << 4));
    sub_factors(_mm_sub_epi8(v, _mm_set1_epi8(32)), f16_at(sb + 108), s->fsub);
}

INLINE void block_q3_k(const uint8_t *sb, const kq_scales *s, int j, __m256i q[2]) {
    const __m256i lo = crumbs(load32(sb + 32 + 32 * (j / 4)), j % 4);
    const __m256i v = _mm256_sub_epi8(_mm256_add_epi8(lo, bit_value(load32(sb), j, 4)), _mm256_set1_epi8(4));
    (void)s;
    widen_i8(v, q);
}

INLINE void scales_q2_k(const uint8_t *sb, kq_scales *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)sb);
    const __m128i m = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    const __m256 dmin = _mm256_set1_ps(f16_at(sb + 82));
    sub_factors(_mm_and_si128(v, _mm_set1_epi8(0x0F)), f16_at(sb + 80), s->fsub);
    s->mn[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)), dmin);
    s->mn[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8))), dmin);
}

INLINE void block_q2_k(const uint8_t *sb, const kq_scales *s, int j, __m256i q[2]) {
    (void)s;
    widen_u8(crumbs(load32(sb + 16 + 32 * (j / 4)), j % 4), q);
}

/* ---- the min terms' activation sums ---- */

INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* xm[t * (k / group) + i] = s_b * (the exact sum of token t's q_x over group i of `group` = 32
 * or 16 in-features), s_b the scale of the block holding the group, rounded once to f32. */
static void x_sums(const int16_t *xq, const float *xsc, int64_t t, int64_t k, int group, float *xm) {
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < t * (k / 32); i++) {
        const __m256i *xb = (const __m256i *)(xq + 32 * i);
        const __m256i lo = _mm256_madd_epi16(_mm256_loadu_si256(xb), one);
        const __m256i hi = _mm256_madd_epi16(_mm256_loadu_si256(xb + 1), one);
        if (group == 32) {
            xm[i] = xsc[i] * (float)hsum_epi32(_mm256_add_epi32(lo, hi));
        } else {
            xm[2 * i] = xsc[i] * (float)hsum_epi32(lo);
            xm[2 * i + 1] = xsc[i] * (float)hsum_epi32(hi);
        }
    }
}

/* ---- one weight row times TT tokens of quantized x ---- */

#define PREFETCH(p, bytes)                                                                     \
    for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                                           \
        _mm_prefetch((const char *)(p) + PREFETCH_AHEAD + pf_, _MM_HINT_T0)

/* Per super-block and token: the blocks' factors times the token's block scales (fs: lane j
 * d sc_j s_b; SUB16, 16-weight sub-blocks: lane s d sc_s s_(s / 2), two multiplies), and
 * MIN_GROUP (32: Q4_K / Q5_K, 16: Q2_K; 0: no min) the min terms, dmin m times xm lane by lane,
 * into the 8-lane accumulator am. Per block j: the integer products into a[t][j % 2] (one FMA
 * with lane j of fs; SUB16: lanes 2 j, then 2 j + 1). Then hsum((a0 + a1) - am) + bias. */
#define KQUANT_DOT(NAME, TYPE_SIZE, MIN_GROUP, SUB16)                                          \
INLINE void dot_##NAME(const uint8_t *w, const int16_t *xq, const float *xs, const float *xm,   \
                       int64_t k, const float *bias, float *y, int64_t ldy, const int TT) {     \
    __m256 a[TOKENS_MAX][2], am[TOKENS_MAX];                                                    \
    for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = am[t] = _mm256_setzero_ps();               \
    const int64_t nb = k / 32, ng = (MIN_GROUP) == 16 ? k / 16 : (MIN_GROUP) == 32 ? k / 32 : 0; \
    for (int64_t sbi = 0; sbi < k / QK_K; sbi++) {                                              \
        const uint8_t *sb = w + sbi * (TYPE_SIZE);                                              \
        PREFETCH(sb, TYPE_SIZE);                                                                \
        kq_scales sc;                                                                           \
        scales_##NAME(sb, &sc);                                                                 \
        _Alignas(32) float fs[TOKENS_MAX][16];                                                  \
        for (int t = 0; t < TT; t++) {                                                          \
            const __m256 sv = _mm256_loadu_ps(xs + t * nb + 8 * sbi);                           \
            if (SUB16) { /* sub-block s takes block s / 2's scale */                           \
                const __m256 lo = _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)); \
                const __m256 hi = _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)); \
                _mm256_store_ps(fs[t], _mm256_mul_ps(sc.fsub[0], lo));                          \
                _mm256_store_ps(fs[t] + 8, _mm256_mul_ps(sc.fsub[1], hi));                      \
            } else {                                                                            \
                _mm256_store_ps(fs[t], _mm256_mul_ps(sc.fd, sv));                               \
            }                                                                                   \
            if ((MIN_GROUP) == 32)                                                              \
                am[t] = _mm256_fmadd_ps(sc.mn[0], _mm256_loadu_ps(xm + t * ng + 8 * sbi), am[t]); \
            if ((MIN_GROUP) == 16) {                                                            \
                am[t] = _mm256_fmadd_ps(sc.mn[0], _mm256_loadu_ps(xm + t * ng + 16 * sbi), am[t]); \
                am[t] = _mm256_fmadd_ps(sc.mn[1], _mm256_loadu_ps(xm + t * ng + 16 * sbi + 8), am[t]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8")                                                                 \
        for (int j = 0; j < 8; j++) { /* block j -> a[t][j % 2]: 8 blocks a super-block */      \
            __m256i q[2];                                                                       \
            block_##NAME(sb, &sc, j, q);                                                        \
            for (int t = 0; t < TT; t++) {                                                      \
                const __m256i *xb = (const __m256i *)(xq + t * k + (sbi * 8 + j) * 32);         \
                const __m256i p0 = _mm256_madd_epi16(q[0], _mm256_loadu_si256(xb));             \
                const __m256i p1 = _mm256_madd_epi16(q[1], _mm256_loadu_si256(xb + 1));         \
                if (SUB16) {                                                                    \
                    a[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(&fs[t][2 * j]), a[t][j & 1]); \
                    a[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(&fs[t][2 * j + 1]), a[t][j & 1]); \
                } else {                                                                        \
                    a[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),  \
                                                  _mm256_broadcast_ss(&fs[t][j]), a[t][j & 1]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int t = 0; t < TT; t++) {                                                              \
        const float s = hsum(_mm256_sub_ps(_mm256_add_ps(a[t][0], a[t][1]), am[t]));            \
        y[t * ldy] = bias ? s + *bias : s;                                                      \
    }                                                                                           \
}

/* The min terms' sums of x for T tokens: on the stack when they fit, else from malloc. */
#define XM_STACK_FLOATS 2048

/* rows [r0, r1) for all T tokens: the sums of x for the min terms (once a call), then per row
 * pairs of tokens and a last single one (gemv.c's order); y NaN if the sums cannot be allocated.
 * And the entry point zllm_gemv_<NAME>, with gemv.c's thread split. */
#define KQUANT_ROWS(NAME, TYPE_SIZE, MIN_GROUP, SUB16)                                         \
KQUANT_DOT(NAME, TYPE_SIZE, MIN_GROUP, SUB16)                                                   \
void gemv_rows_##NAME(const gemv_args *a, int64_t r0, int64_t r1) {                             \
    const int64_t n = a->n, k = a->k, ng = (MIN_GROUP) == 16 ? k / 16 : (MIN_GROUP) == 32 ? k / 32 : 0; \
    float stack[XM_STACK_FLOATS], *xm = stack;                                                  \
    if (MIN_GROUP) {                                                                            \
        xm = a->t * ng <= XM_STACK_FLOATS ? stack : malloc((size_t)(a->t * ng) * sizeof(float)); \
        if (!xm) {                                                                              \
            for (int64_t t = 0; t < a->t; t++)                                                  \
                for (int64_t r = r0; r < r1; r++) a->y[t * n + r] = NAN;                        \
            return;                                                                             \
        }                                                                                       \
        x_sums(a->xq, a->xsc, a->t, k, MIN_GROUP, xm);                                          \
    }                                                                                           \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        const uint8_t *wr = (const uint8_t *)a->w + r * a->ws;                                  \
        const float *br = a->bias ? a->bias + r : 0;                                            \
        int64_t t = 0;                                                                          \
        for (; t + 2 <= a->t; t += 2)                                                           \
            dot_##NAME(wr, a->xq + t * k, a->xsc + t * (k / 32), xm + t * ng, k, br, a->y + t * n + r, n, 2); \
        if (t < a->t)                                                                           \
            dot_##NAME(wr, a->xq + t * k, a->xsc + t * (k / 32), xm + t * ng, k, br, a->y + t * n + r, n, 1); \
    }                                                                                           \
    if (xm != stack) free(xm);                                                                  \
}                                                                                               \
void zllm_gemv_##NAME(const uint8_t *w, int64_t ws, const float *x, int64_t xs, const float *bias, \
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {                 \
    gemv_quantized(w, ws, x, xs, bias, y, t, n, k, k / QK_K * (TYPE_SIZE), threads, gemv_rows_##NAME); \
}

KQUANT_ROWS(q2_k, 84, 16, 1)
KQUANT_ROWS(q3_k, 110, 0, 1)
KQUANT_ROWS(q4_k, 144, 32, 0)
KQUANT_ROWS(q5_k, 176, 32, 0)
KQUANT_ROWS(q6_k, 210, 0, 1)
