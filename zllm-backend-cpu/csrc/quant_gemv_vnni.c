/* INT8 rows of the HF kernel layout (int8_g, quant_gemv.c) through AVX512-VNNI integer dot
 * products, keeping f32-class activations: y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y
 * f32, w[n, k] = scales[n, k / g] * (q[n, k] - zeros[n, k / g]), q uint8.
 *
 * x as exact integer digits (quant_digits.c, once per call, per token and per block of up to
 * DIGITS_BLOCK columns inside one scale group): x = d (a0 + a1 2^-7 + a2 2^-14 + a3 2^-21) + r,
 * d a power of two, |a0| <= 127, |a1 .. a3| <= 64, |r| ~ 2^-28 of the block's max |x| (measured
 * against the f64 result with x ~ N(0, 1), one |x| 1000x the rest, x + 1 and x over 2^-20 ..
 * 2^4, K 3328 / 14336, per channel and groups of 128: the same error as quant_gemv.c's AVX-512
 * kernel, 3e-8 .. 4e-6 of sum |w x|).
 *
 * The unsigned q are the u8 operand of vpdpbusd as stored: per 64 columns one load and four
 * vpdpbusd (digit i into int32 accumulator i), instead of quant_gemv.c's twelve operations (zero
 * extension, conversion, FMA per 16). Each int32 lane adds 4 products of at most 255 * 127 per
 * 64 columns: over a block of DIGITS_BLOCK columns |c_i| < 2^19. Per block the digit pairs are
 * combined as integers, hi = c0 2^7 + c1 and lo = c2 2^7 + c3 (exact, < 2^27), converted (f32
 * rounds hi past 2^24: 2^-24 of it), hi d 2^-7 + lo d 2^-21 (one product and one FMA) into the
 * group's 16-lane f32 sum; per group its lane 0 minus z times the group's x sum (x in 16 lanes,
 * column c in lane c % 16, then a fixed horizontal sum), times the scale into a 16-lane row
 * total (s (sum q x - z sum x), as quant_gemv.c's dot_int8_512); then a fixed horizontal sum and
 * + bias.
 *
 * Applies at the AVX-512 level (isa.h's flags include avx512vnni; ZLLM_NATIVE_ISA=avx2 keeps
 * the AVX2 kernels) where K and g are multiples of 64 (per-channel rows: g = K); else
 * quant_gemv.c's kernels take the call. A token whose x holds a non-finite value, or a block
 * whose max |x| is nonzero but under 2^-99 (its last digit's weight would not be a normal f32),
 * goes to them alone (gemv_int8): a token's kernel depends on its own x only.
 *
 * Measured (docs/performance.md; per call, one thread, CPU time, against quant_gemv.c's
 * dot_int8_512): per channel 1.06-1.29x at T = 1, groups of 128 0.98-1.31x, T = 2 0.93-0.99x
 * (eight vpdpbusd per 64 columns against dot_int8_512's decode shared by two tokens); batch-1
 * decode reads its weights at memory speed, so end to end the change is inside the noise.
 *
 * Order: a row's result depends only on its quants, its token's x, K, g and DIGITS_BLOCK, never
 * on T, N, the other rows or the thread split. Tokens go two at a time through one load of a
 * row, each token's accumulators taking the same operations as alone. Threads: the work items
 * of quant_gemv.c's gemv (about DIGITS_CHUNK_BYTES of weights, handed out dynamically: quant_digits.c).
 */
#include "common.h"
#include "isa.h"
#include "quant_digits.h"


#define VNNI_TOKENS 2
#define VNNI_PREFETCH 2048

INLINE AVX512 float hsum512_vnni(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* The row's 64 quants at q against TT tokens' digits at dg (tokens stride bytes apart) into
 * the int32 accumulators a[t][i]. */
INLINE AVX512 void step64(const uint8_t *q, const uint8_t *dg, int64_t stride, const int TT,
                          __m512i a[VNNI_TOKENS][DIGITS_N]) {
    const __m512i v = _mm512_loadu_si512(q);
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < DIGITS_N; i++)
            a[t][i] = _mm512_dpbusd_epi32(a[t][i], v, _mm512_loadu_si512(dg + t * stride + 64 * i));
}

/* The columns [c0, c1) of a row (a block, a multiple of 64) against TT tokens' digits: its
 * digit sums combined, hi = (c0 << 7) + c1 and lo = (c2 << 7) + c3 (exact in int32: |c_i| <
 * 2^22 for blocks up to 4096 columns), as f32 hi w_hi + lo w_lo into s[t]. (Two accumulator
 * sets for alternate 64-column steps measured no faster: the blocks' chains overlap already.) */
INLINE AVX512 void block_vnni(const digits_layout *L, const uint8_t *row, const uint8_t *dg, int64_t c0,
                              int64_t c1, int64_t b, const int TT, __m512 s[VNNI_TOKENS]) {
    __m512i a0[VNNI_TOKENS][DIGITS_N];
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < DIGITS_N; i++) a0[t][i] = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += 64) {
        _mm_prefetch((const char *)row + c + VNNI_PREFETCH, _MM_HINT_T0);
        step64(row + c, dg + 4 * c, L->stride, TT, a0);
    }
    for (int t = 0; t < TT; t++) {
        const float *wb = (const float *)(dg + t * L->stride + L->w_at) + 2 * b;
        const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(a0[t][0], 7), a0[t][1]);
        const __m512i lo = _mm512_add_epi32(_mm512_slli_epi32(a0[t][2], 7), a0[t][3]);
        s[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(wb[0]),
                               _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(wb[1])));
    }
}

/* Row r times TT tokens' digits (file comment) -> y[t]. */
INLINE AVX512 void dot_vnni(const digits_layout *L, const uint8_t *row, const float *sf, const uint8_t *zr,
                            const uint8_t *dg, float *y, const int TT) {
    const int64_t k = L->k, g = L->g;
    __m512 tot[VNNI_TOKENS];
    for (int t = 0; t < TT; t++) tot[t] = _mm512_setzero_ps();
    int64_t b = 0;
    for (int64_t gi = 0; gi < L->ng; gi++) {
        const int64_t c0 = gi * g, ge = c0 + g < k ? c0 + g : k;
        __m512 gs[VNNI_TOKENS];
        int64_t c1 = c0 + DIGITS_BLOCK < ge ? c0 + DIGITS_BLOCK : ge;
        block_vnni(L, row, dg, c0, c1, b++, TT, gs);
        for (int64_t cb; c1 < ge; c1 = cb, b++) {
            cb = c1 + DIGITS_BLOCK < ge ? c1 + DIGITS_BLOCK : ge;
            __m512 s[VNNI_TOKENS];
            block_vnni(L, row, dg, c1, cb, b, TT, s);
            for (int t = 0; t < TT; t++) gs[t] = _mm512_add_ps(gs[t], s[t]);
        }
        const __m512 sc = _mm512_set1_ps(sf[gi]);
        const float z = zr ? (float)zr[gi] : 0.0f;
        for (int t = 0; t < TT; t++) {
            const float sum_x = ((const float *)(dg + t * L->stride + L->sums_at))[gi];
            const __m512 zx = _mm512_set1_ps(z * sum_x);
            tot[t] = _mm512_fmadd_ps(_mm512_mask_sub_ps(gs[t], 1, gs[t], zx), sc, tot[t]);
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum512_vnni(tot[t]);
}

/* Rows [r0, r1) times all T tokens' digits -> y [T, N]. */
AVX512 static void rows_vnni(const digits_layout *L, const uint8_t *q, const float *scales, const uint8_t *zeros,
                             const uint8_t *dg, const float *bias, float *y, int64_t n, int64_t t, int64_t r0,
                             int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = q + r * L->k, *zr = zeros ? zeros + r * L->ng : 0;
        const float *sf = scales + r * L->ng;
        float v[VNNI_TOKENS];
        int64_t j = 0;
        for (; j + VNNI_TOKENS <= t; j += VNNI_TOKENS) {
            dot_vnni(L, row, sf, zr, dg + j * L->stride, v, VNNI_TOKENS);
            for (int i = 0; i < VNNI_TOKENS; i++) y[(j + i) * n + r] = bias ? v[i] + bias[r] : v[i];
        }
        if (j < t) {
            dot_vnni(L, row, sf, zr, dg + j * L->stride, v, 1);
            y[j * n + r] = bias ? v[0] + bias[r] : v[0];
        }
    }
}

/* quant_digits.h: the leading tokens whose x digits_split_token holds, through rows_vnni. */
int64_t int8_vnni_gemv(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g, const float *x,
                       int64_t xs, const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    if (native_isa_level < ISA_AVX512 || k <= 0 || k % 64 || g <= 0 || (g % 64 && g < k) || t <= 0 || n <= 0)
        return -1;
    return digits_gemv(rows_vnni, DIGITS_COLUMNS, k, q, scales, zeros, g, x, xs, bias, y, t, n, k, threads);
}
