/* f32 activations as exact integer digits (quant_digits.h), for the GEMVs that multiply
 * integer quants by them in integer dot products: quant_gemv_vnni.c (INT8 rows, AVX512-VNNI)
 * and quant_gemv_int4.c (INT4 rows, AVX2 vpmaddubsw).
 *
 * Per token and per block of up to DIGITS_BLOCK columns inside one scale group: with m the
 * block's max |x| and d = 2^E the smallest power of two with 127 d >= m, x = d (a0 + a1 2^-7 +
 * a2 2^-14 + a3 2^-21) + r, each digit the remainder so far divided by its weight d 2^-7i and
 * rounded to the nearest integer (ties to even): |a0| <= 127, |a1 .. a3| <= 64 (each remainder
 * is at most half the last digit's weight), int8. Every remainder is exact in f32 (a multiple
 * of d 2^-7i subtracted from a number within half of it), so |r| <= d 2^-22 < m 2^-21 / 127 ~
 * m 2^-28: four digits hold x to 2^-28 of its block's max, below f32's own rounding of that max
 * (2^-24); three would leave m 2^-21, eight times that rounding. An element 1000x smaller than
 * its block's max keeps ~2^-18 of itself, and its product with q is summed against the
 * outlier's, so relative to sum |q x| the error stays ~2^-28 per element.
 *
 * Each digit is a function of its element and its block's E only, so the 8-lane steps here give
 * the same digits as any other width (the AVX-512 split this replaced: the same bits through
 * quant_gemv_vnni.c). The sums of x are in fixed orders: a group's sum (DIGITS_COLUMNS) column c
 * into lane c % 16 (two 8-lane halves), the halves added, then common.h's hsum; a block's lane
 * sums (DIGITS_NIBBLES) per 64-column step a tree of vhaddps over each 8 columns, added step by
 * step. The split runs once per token and call, ~3 vector operations per column, against the
 * GEMV's N rows of that column.
 */
#include "quant_digits.h"

#include "common.h"

#include <float.h>
#include <stdlib.h>
#include <string.h>

/* 2^e for e in [-126, 127]: the f32 of those exponent bits. */
static inline float pow2(int e) {
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

digits_layout digits_layout_of(int64_t k, int64_t g, int order) {
    digits_layout L = {.k = k, .g = g < k ? g : k, .order = order};
    L.ng = (k + L.g - 1) / L.g;
    L.nb = L.ng * ((L.g + DIGITS_BLOCK - 1) / DIGITS_BLOCK); /* at most: a last, shorter group may take fewer */
    L.w_at = 4 * k;
    L.sums_at = L.w_at + 8 * L.nb;
    L.stride = (L.sums_at + (order == DIGITS_NIBBLES ? 32 * L.nb : 4 * L.ng) + 63) & ~(int64_t)63;
    return L;
}

/* The 8 int32 digits of d[0..3] (4 x 8 lanes) as 32 int8 in lane order: d[0]'s 8, then d[1]'s ... */
INLINE __m256i pack32(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(d0, d1), _mm256_packs_epi32(d2, d3));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The 8 sums of v[j]'s 8 lanes, sum j in lane j. */
INLINE __m256 lane_sums8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The 64 columns of x at p as 8 vectors in the byte order of the digits (quant_digits.h):
 * DIGITS_COLUMNS v[j] columns 8j .. 8j + 7; DIGITS_NIBBLES v[j] the even columns of 16j .. 16j +
 * 15 and v[4 + j] their odd ones, each in column order. */
INLINE void step_sources(const float *p, int order, __m256 v[8]) {
    if (order == DIGITS_COLUMNS) {
        for (int j = 0; j < 8; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
        return;
    }
    const __m256i idx = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int j = 0; j < 4; j++) {
        const __m256 a = _mm256_loadu_ps(p + 16 * j), b = _mm256_loadu_ps(p + 16 * j + 8);
        v[j] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, 0x88), idx);     /* columns 0, 2, .. 14 */
        v[4 + j] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, 0xDD), idx); /* 1, 3, .. 15 */
    }
}

int digits_split_token(const digits_layout *L, const float *x, uint8_t *out) {
    float *ws = (float *)(out + L->w_at), *sums = (float *)(out + L->sums_at);
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    int64_t b = 0;
    for (int64_t gi = 0; gi < L->ng; gi++) {
        const int64_t ge = (gi + 1) * L->g < L->k ? (gi + 1) * L->g : L->k;
        __m256 sx[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c0 = gi * L->g, c1; c0 < ge; c0 = c1, b++) {
            c1 = c0 + DIGITS_BLOCK < ge ? c0 + DIGITS_BLOCK : ge;
            __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int64_t c = c0; c < c1; c += 16)
                for (int h = 0; h < 2; h++) {
                    const __m256 v = _mm256_loadu_ps(x + c + 8 * h), a = _mm256_andnot_ps(sign, v);
                    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* NaN or +-inf */
                    mx = _mm256_max_ps(mx, a);
                    if (L->order == DIGITS_COLUMNS) sx[h] = _mm256_add_ps(sx[h], v);
                }
            if (_mm256_movemask_ps(bad)) return 0;
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))); /* exact in any order */
            int e = 0;
            if (m > 0.0f) {
                uint32_t u;
                memcpy(&u, &m, 4);
                e = (int)(u >> 23) - 133; /* m in [2^(e + 6), 2^(e + 7)): 127 2^e < m is possible, then one more */
                if (e < DIGITS_MIN_E) return 0;
                if (127.0f * pow2(e) < m) e++;
            }
            ws[2 * b] = pow2(e - 7);
            ws[2 * b + 1] = pow2(e - 21);
            __m256 inv[DIGITS_N], wt[DIGITS_N]; /* the digit weights d 2^-7i and their inverses */
            for (int i = 0; i < DIGITS_N; i++) {
                wt[i] = _mm256_set1_ps(pow2(e - 7 * i));
                inv[i] = _mm256_set1_ps(pow2(7 * i - e));
            }
            __m256 lsum = _mm256_setzero_ps();
            for (int64_t c = c0; c < c1; c += 64) {
                __m256 r[8];
                if (L->order == DIGITS_NIBBLES) {
                    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(x + c + 8 * j);
                    lsum = _mm256_add_ps(lsum, lane_sums8(r));
                }
                step_sources(x + c, L->order, r);
                for (int i = 0; i < DIGITS_N; i++) {
                    __m256i a[8];
                    for (int j = 0; j < 8; j++) {
                        const __m256 ai = _mm256_round_ps(_mm256_mul_ps(r[j], inv[i]),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        r[j] = _mm256_fnmadd_ps(ai, wt[i], r[j]); /* exact (file comment) */
                        a[j] = _mm256_cvtps_epi32(ai);
                    }
                    uint8_t *o = out + 4 * c + 64 * i;
                    _mm256_storeu_si256((__m256i *)o, pack32(a[0], a[1], a[2], a[3]));
                    _mm256_storeu_si256((__m256i *)(o + 32), pack32(a[4], a[5], a[6], a[7]));
                }
            }
            if (L->order == DIGITS_NIBBLES) _mm256_storeu_ps(sums + 8 * b, lsum);
        }
        if (L->order == DIGITS_COLUMNS) sums[gi] = hsum(_mm256_add_ps(sx[0], sx[1]));
    }
    return 1;
}

/* quant_digits.h */
int64_t digits_gemv(digit_rows_fn rows, int order, int64_t row_bytes, const uint8_t *q, const float *scales,
                    const uint8_t *zeros, int64_t g, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                    int64_t n, int64_t k, int threads) {
    const digits_layout L = digits_layout_of(k, g, order);
    uint8_t *dg = aligned_alloc(64, (size_t)(t * L.stride));
    if (!dg) return -1;
    int64_t run = 0;
    while (run < t && digits_split_token(&L, x + run * xs, dg + run * L.stride)) run++;
    const int64_t per = DIGITS_CHUNK_BYTES / row_bytes, each = per > 1 ? per : 1, items = (n + each - 1) / each;
    const int nth = gemv_team(threads, items, n * row_bytes * run);
    if (run > 0) {
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++)
            rows(&L, q, scales, zeros, dg, bias, y, n, run, i * each, (i + 1) * each < n ? (i + 1) * each : n);
    }
    free(dg);
    return run;
}
