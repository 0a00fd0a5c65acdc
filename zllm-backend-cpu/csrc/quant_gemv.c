/* Native GEMV and row decode for the HF quantized kernel layouts (FP8 E4M3 with block
 * scales, INT4 / INT8 group-quantized with zero points, MXFP4, NVFP4):
 * y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y f32, W decoded inside the kernel.
 *
 * Layouts (the kernel layouts of issue #14, one part per argument, all contiguous):
 *   fp8_e4m3: q uint8 [N, K] (E4M3FN bits), scale f32 [ceil(N / bn), ceil(K / bk)];
 *             w[n, k] = e4m3(q[n, k]) * scale[n / bn, k / bk].
 *   int4_g:   q uint8 [N, K / 2] (byte j: low nibble = column 2j, high = 2j + 1),
 *   int8_g:   q uint8 [N, K] (unsigned); both with scales f32 [N, K / g] and zeros uint8
 *             [N, K / g]: w[n, k] = scales[n, k / g] * (q[n, k] - zeros[n, k / g]).
 *   mxfp4:    q uint8 [N, K / 2] (low nibble = even column), scales uint8 [N, K / 32] (E8M0):
 *             w = E2M1(nibble) * 2^(scale - 127).
 *   nvfp4:    q uint8 [N, K / 2], scales uint8 [N, K / 16] (E4M3FN bits), one f32 global
 *             scale: w = E2M1(nibble) * (e4m3(scale) * global).
 *
 * FP8 (f32 activations): E4M3FN -> f16 bits: sign << 15 | (byte & 0x7F) << 7 is the same
 * number times 2^-8 (normal and subnormal alike: the exponent bias goes from 7 to 15),
 * converted with F16C, exact; the 2^8 is folded into the scale (NaN bytes 0x7F / 0xFF decode
 * to 480: a checkpoint holds no NaN weights). Per scale block, two 8-lane f32 accumulators;
 * the block's sum times its scale into an 8-lane row total (one FMA); a block's last bk % 16
 * columns one scalar FMA at a time. Against the f32 reference (dequantize, then x @ W^T) only
 * rounding differs, ~1e-6 relative.
 *
 * INT4 / INT8 / MXFP4 / NVFP4 (int16 activations, as gemv.c's GGUF blocks and for the same
 * reason: converting every quant to f32 made the loops instruction-bound): x is quantized
 * once per call per block of 32 in-features (s_b = max|x_b| / 32767, q = round(x / s_b)),
 * in the nibble layouts with each block's even columns first, then its odd ones, so that the
 * low / high nibbles of 16 bytes meet their activations without shuffling weights. Per
 * 32-column block: q - zero (int16, exact) or twice the E2M1 value (an integer: one byte
 * shuffle of a 16-entry table), two madds into 8 exact int32 lanes, converted and scaled by
 * (weight scale * s_b) into one of two 8-lane accumulators (one FMA; 16-column groups give
 * lanes 0-3 and 4-7 their own scale). |y - y_ref| <= sum_b (s_b / 2) sum_(i in b) |w_i|
 * plus f32 rounding, ~1e-5 relative (int8 with |q - zero| up to 255: a lane's 4 products
 * may pass 2^24, one more f32 rounding of 2^-24).
 *
 * Order: every output element is reduced in an order that depends only on the layout and K
 * (never on T, N, the other rows or the thread split; x's quantization only on its own row):
 * an output row is bit-identical whatever else is in the call.
 *
 * Threads: OpenMP with the caller's thread count (the libgomp torch loaded, as gemv.c). The
 * rows are cut into work items of about CHUNK_BYTES of weights handed out dynamically, so a
 * thread the OS deschedules on a busy machine holds up one item, not a static share. Each
 * token is multiplied with the row in turn; the row stays in L1 for the next token (T is
 * small here: prefill decodes row tiles with zllm_qdecode_* and multiplies them with torch).
 */
#include "common.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK_BYTES (64 << 10) /* weight bytes per work item */
#define PREFETCH_AHEAD 2048    /* bytes: the decode loops retire few bytes per instruction */

/* The operands of one call; fields a layout does not use are 0. */
typedef struct {
    const uint8_t *q;      /* quants, row stride row_bytes */
    const void *scales;    /* f32 (fp8, int) or uint8 (mxfp4, nvfp4) */
    const uint8_t *zeros;  /* int4_g / int8_g */
    float global;          /* nvfp4 */
    int64_t n, k, g;       /* g: columns per scale group (fp8: bk) */
    int64_t bn;            /* fp8: rows per scale block */
    int64_t row_bytes;
} qweight;

/* ---- scalar tables, filled once ---- */

static float E4M3[256];  /* E4M3FN byte -> value (NaN bytes -> NaN) */
static float E8M0[256];  /* E8M0 byte -> 2^(b - 127) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static void fill_tables(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        E4M3[b] = (b & 0x7F) == 0x7F ? NAN : (b & 0x80 ? -v : v);
        E8M0[b] = ldexpf(1.0f, b - 127); /* 255 -> inf, as transformers' ldexp decode */
    }
}

static void tables(void) {
    static int done = 0;
    if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) { /* idempotent: racing fills write the same */
        fill_tables();
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
}

/* ---- FP8: 16 quants as two 8-lane f32 vectors (lo = columns 0..7, hi = 8..15) ---- */

/* 16 E4M3FN bytes -> their values times 2^-8 (file comment). The f16 bits in three
 * operations: the byte sign-extended to 16 bits and shifted left by 7 holds the sign in bit
 * 15, a copy of it in bit 14 and the 7 magnitude bits in bits 7-13; the mask 0xBF80 drops
 * the copy. */
INLINE void fp8x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

#define PREFETCH_ROW(p) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T0)

/* One FP8 row times one token: per scale block (bk columns), sum q * x in two 8-lane f32
 * accumulators, then * the block's scale into the row total (one FMA); a block's last
 * bk % 16 columns one scalar FMA at a time into a scalar tail. */
static float dot_fp8(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k, bk = w->g, sk = (k + bk - 1) / bk;
    const uint8_t *row = w->q + r * w->row_bytes;
    const float *sc = (const float *)w->scales + r / w->bn * sk;
    __m256 tot = _mm256_setzero_ps();
    float tail = 0.0f;
    for (int64_t b = 0; b < sk; b++) {
        const int64_t c0 = b * bk, c1 = c0 + bk < k ? c0 + bk : k;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) {
            __m256 lo, hi;
            PREFETCH_ROW(row + c);
            fp8x16(row + c, &lo, &hi);
            a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + c), a0);
            a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + c + 8), a1);
        }
        tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sc[b] * 256.0f), tot);
        for (; c < c1; c++) tail = fmaf(E4M3[row[c]] * sc[b], x[c], tail);
    }
    return hsum(tot) + tail;
}

/* ---- INT4 / INT8 / E2M1: integer dot products with int16 activations ---- */

INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* One activation block of 32 (as gemv.c's quantize_block): q = round(x / s) to nearest
 * even, s = max|x| / 32767; s = 0 and q = 0 for a block of zeros or an underflowing scale,
 * s = NaN and q = 0 for a block holding a NaN or an infinity. Nibble layouts (deint) store
 * the block's even columns first, then its odd ones: a nibble byte holds an even and an odd
 * column, and this order pairs them with their activations without shuffling weights. */
static void quantize_block(const float *x, int16_t *q, float *s, int deint) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 v[4], m = zero, bad = zero;
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        bad = _mm256_add_ps(bad, _mm256_mul_ps(v[i], zero)); /* 0, or NaN for NaN / inf */
    }
    const float sb = hmax(m) / 32767.0f + hsum(bad);
    *s = sb;
    if (!(sb > 0.0f)) {
        memset(q, 0, 32 * sizeof *q);
        return;
    }
    _Alignas(32) int32_t n[32];
    for (int i = 0; i < 4; i++)
        _mm256_store_si256((__m256i *)(n + 8 * i), _mm256_cvtps_epi32(_mm256_div_ps(v[i], _mm256_set1_ps(sb))));
    for (int i = 0; i < 16; i++) {
        q[deint ? i : 2 * i] = (int16_t)n[2 * i];
        q[deint ? 16 + i : 2 * i + 1] = (int16_t)n[2 * i + 1];
    }
}

/* 16 nibble bytes (32 columns): even columns' nibbles in q[0], odd in q[1], int16 lanes. */
INLINE void nibbles32(const uint8_t *p, __m256i q[2]) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    q[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(v, 4);
}

/* 16 nibble bytes (32 columns) as twice their E2M1 values (integers: 0 1 2 3 4 6 8 12, bit
 * 3 = sign), one byte shuffle of a 16-entry int8 table per 16 nibbles, widened to int16:
 * even columns in q[0], odd in q[1]. */
INLINE void e2m1x2_32(const uint8_t *p, __m256i q[2]) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    q[0] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(b, mask)));
    q[1] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}

INLINE __m256 halves(float lo, float hi) { return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)); }
INLINE __m256i halves16(int lo, int hi) { return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo)); }

INLINE __m256i madd2(__m256i q0, __m256i q1, const int16_t *x) {
    const __m256i *xb = (const __m256i *)x;
    return _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(xb)),
                            _mm256_madd_epi16(q1, _mm256_loadu_si256(xb + 1)));
}

enum { L_INT4, L_INT8, L_MXFP4, L_NVFP4, L_FP8 };

/* Block b (32 columns) of a row into *acc: the exact int32 lanes of (weight quant) * (x
 * quant), as f32, times the lanes' scales (weight scale * s_b), one FMA. gi: the block's
 * group (int layouts with g >= 32). madd pairs adjacent int16 lanes, so with 16-column
 * groups (nvfp4; int4_g / int8_g with g = 16, `half`) int32 lanes 0-3 of a nibble block
 * belong to its first group and 4-7 to its second; int8's two halves are summed apart. */
INLINE void block_step(const qweight *w, const uint8_t *row, const uint8_t *zr, const void *scales, int64_t b,
                       int64_t gi, const int16_t *xq, const float *xs, const int layout, const int half,
                       __m256 *acc) {
    const int16_t *x = xq + 32 * b;
    const float *sf = (const float *)scales;
    const uint8_t *s8 = (const uint8_t *)scales;
    __m256i p;
    __m256 scale;
    if (layout == L_INT8) {
        const uint8_t *blk = row + 32 * b;
        PREFETCH_ROW(blk);
        const __m256i q0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
        const __m256i q1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16)));
        if (half) {
            const __m256i *xb = (const __m256i *)x;
            const __m256i p0 = _mm256_madd_epi16(_mm256_sub_epi16(q0, _mm256_set1_epi16(zr[2 * b])),
                                                 _mm256_loadu_si256(xb));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sf[2 * b] * xs[b]), *acc);
            p = _mm256_madd_epi16(_mm256_sub_epi16(q1, _mm256_set1_epi16(zr[2 * b + 1])), _mm256_loadu_si256(xb + 1));
            scale = _mm256_set1_ps(sf[2 * b + 1] * xs[b]);
        } else {
            const __m256i z = _mm256_set1_epi16(zr[gi]);
            p = madd2(_mm256_sub_epi16(q0, z), _mm256_sub_epi16(q1, z), x);
            scale = _mm256_set1_ps(sf[gi] * xs[b]);
        }
    } else {
        PREFETCH_ROW(row + 16 * b);
        __m256i q[2];
        if (layout == L_INT4) {
            nibbles32(row + 16 * b, q);
            const __m256i z = half ? halves16(zr[2 * b], zr[2 * b + 1]) : _mm256_set1_epi16(zr[gi]);
            p = madd2(_mm256_sub_epi16(q[0], z), _mm256_sub_epi16(q[1], z), x);
            scale = half ? halves(sf[2 * b] * xs[b], sf[2 * b + 1] * xs[b]) : _mm256_set1_ps(sf[gi] * xs[b]);
        } else if (layout == L_MXFP4) { /* the 1/2 of the doubled E2M1 values goes into the scale */
            e2m1x2_32(row + 16 * b, q);
            p = madd2(q[0], q[1], x);
            scale = _mm256_set1_ps(E8M0[s8[b]] * 0.5f * xs[b]);
        } else {
            e2m1x2_32(row + 16 * b, q);
            p = madd2(q[0], q[1], x);
            const float s = w->global * 0.5f * xs[b];
            scale = halves(E4M3[s8[2 * b]] * s, E4M3[s8[2 * b + 1]] * s);
        }
    }
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, *acc);
}

/* One row times one token of quantized x (xq, scales xs): blocks alternate between two
 * accumulators (even / odd block of each group), walked group by group so that a group's
 * zero point and scale are read once, then a0 + a1 and a fixed horizontal sum. */
INLINE float dot_blocks(const qweight *w, int64_t r, const int16_t *xq, const float *xs, const int layout,
                        const int half) {
    const int64_t nb = w->k / 32, ng = w->k / w->g;
    const int64_t per = (layout == L_INT4 || layout == L_INT8) && !half ? w->g / 32 : nb; /* blocks a group */
    const uint8_t *row = w->q + r * w->row_bytes, *zr = w->zeros ? w->zeros + r * ng : 0;
    const void *scales = layout == L_INT4 || layout == L_INT8 ? (const void *)((const float *)w->scales + r * ng)
                                                               : (const void *)((const uint8_t *)w->scales + r * ng);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t gi = 0, b = 0; b < nb; gi++) {
        const int64_t end = b + per;
        for (; b + 2 <= end; b += 2) {
            block_step(w, row, zr, scales, b, gi, xq, xs, layout, half, &a0);
            block_step(w, row, zr, scales, b + 1, gi, xq, xs, layout, half, &a1);
        }
        if (b < end) block_step(w, row, zr, scales, b++, gi, xq, xs, layout, half, &a0);
    }
    return hsum(_mm256_add_ps(a0, a1));
}

static float dot_int4(const qweight *w, int64_t r, const int16_t *xq, const float *xs) {
    return w->g == 16 ? dot_blocks(w, r, xq, xs, L_INT4, 1) : dot_blocks(w, r, xq, xs, L_INT4, 0);
}
static float dot_int8(const qweight *w, int64_t r, const int16_t *xq, const float *xs) {
    return w->g == 16 ? dot_blocks(w, r, xq, xs, L_INT8, 1) : dot_blocks(w, r, xq, xs, L_INT8, 0);
}
static float dot_mxfp4(const qweight *w, int64_t r, const int16_t *xq, const float *xs) {
    return dot_blocks(w, r, xq, xs, L_MXFP4, 0);
}
static float dot_nvfp4(const qweight *w, int64_t r, const int16_t *xq, const float *xs) {
    return dot_blocks(w, r, xq, xs, L_NVFP4, 0);
}

/* ---- one row decoded to f32, as the reference zllm.domain.quant_hf computes it ---- */

/* The 16 nibbles of 8 bytes at p in column order (low nibble first), uint8 lanes. */
INLINE __m128i nibbles16(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
}

/* Columns c .. c + 15 of a row as f32 lanes before the group's scale: E4M3 values times 2^-8
 * (fp8), q - z (int), twice the E2M1 values (fp4); the scale takes the factor back. */
INLINE void cols16(const uint8_t *row, int64_t c, int z, const int layout, __m256 *lo, __m256 *hi) {
    if (layout == L_FP8) {
        fp8x16(row + c, lo, hi);
        return;
    }
    if (layout == L_MXFP4 || layout == L_NVFP4) {
        const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        const __m128i v = _mm_shuffle_epi8(table, nibbles16(row + c / 2));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
        return;
    }
    const __m128i q = layout == L_INT4 ? nibbles16(row + c / 2) : _mm_loadu_si128((const __m128i *)(row + c));
    const __m256i v = _mm256_sub_epi16(_mm256_cvtepu8_epi16(q), _mm256_set1_epi16((short)z));
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

/* One column's value before its scale (E4M3, q - z, E2M1), for the columns a 16-wide step leaves. */
INLINE float col1(const uint8_t *row, int64_t c, int z, const int layout) {
    if (layout == L_FP8) return E4M3[row[c]];
    if (layout == L_INT8) return (float)(row[c] - z);
    const int nib = c & 1 ? row[c / 2] >> 4 : row[c / 2] & 15;
    return layout == L_INT4 ? (float)(nib - z) : E2M1[nib];
}

/* Row r, group by group: each value the reference's one rounding of (exact value) * scale
 * (nvfp4's scale formed first as e4m3 * global, as the reference does); in the vector steps
 * the scaled-down value times the scaled-up scale is the same real product, so the same f32. */
INLINE void decode_row(const qweight *w, int64_t r, float *out, const int layout) {
    const int64_t k = w->k, g = w->g, ng = (k + g - 1) / g;
    const uint8_t *row = w->q + r * w->row_bytes;
    const uint8_t *zr = w->zeros ? w->zeros + r * ng : 0, *s8 = (const uint8_t *)w->scales + r * ng;
    const float *sf = (const float *)w->scales + (layout == L_FP8 ? r / w->bn : r) * ng;
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        const int z = zr ? zr[gi] : 0;
        float s, vs; /* the group's scale, and the scale of the vector steps' values */
        if (layout == L_FP8) s = sf[gi], vs = s * 256.0f;
        else if (layout == L_INT4 || layout == L_INT8) s = sf[gi], vs = s;
        else if (layout == L_MXFP4) s = E8M0[s8[gi]], vs = s * 0.5f;
        else s = E4M3[s8[gi]] * w->global, vs = s * 0.5f;
        int64_t c = gi * g;
        if (layout != L_INT4 || c % 2 == 0)
            for (; c + 16 <= c1; c += 16) {
                __m256 lo, hi;
                cols16(row, c, z, layout, &lo, &hi);
                _mm256_storeu_ps(out + c, _mm256_mul_ps(lo, _mm256_set1_ps(vs)));
                _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(hi, _mm256_set1_ps(vs)));
            }
        for (; c < c1; c++) out[c] = layout == L_INT4 || layout == L_INT8 ? s * col1(row, c, z, layout)
                                                                           : col1(row, c, z, layout) * s;
    }
}

static void decode_fp8(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_FP8); }
static void decode_int4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_INT4); }
static void decode_int8(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_INT8); }
static void decode_mxfp4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_MXFP4); }
static void decode_nvfp4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_NVFP4); }

/* ---- the thread split and the entry points ---- */

typedef float (*dot_fn)(const qweight *w, int64_t r, const float *x);
typedef float (*qdot_fn)(const qweight *w, int64_t r, const int16_t *xq, const float *xs);
typedef void (*decode_fn)(const qweight *w, int64_t r, float *out);

/* The quantized x, on the stack up to XQ_STACK_BYTES (every decode step of a small model). */
#define XQ_STACK_BYTES (16 << 10)

/* y = x W^T (+ bias) with `dot` (f32 activations) or `qdot` (x quantized per block of 32
 * first, in the nibble order when deint): rows in work items handed out dynamically. If
 * the quantized x cannot be allocated, y is NaN. */
static void gemv(const qweight *w, dot_fn dot, qdot_fn qdot, int deint, const float *x, int64_t xs,
                 const float *bias, float *y, int64_t t, int threads) {
    tables();
    const int64_t n = w->n, k = w->k, nb = qdot ? k / 32 : 0, per = CHUNK_BYTES / (w->row_bytes > 0 ? w->row_bytes : 1);
    const int64_t rows = per > 1 ? per : 1, items = (n + rows - 1) / rows;
    int nth = threads < items ? threads : (int)items;
    nth = nth < MAX_THREADS ? (nth > 1 ? nth : 1) : MAX_THREADS;
    const size_t bytes = (size_t)(t * nb) * (32 * sizeof(int16_t) + sizeof(float));
    _Alignas(32) unsigned char stack[XQ_STACK_BYTES];
    unsigned char *buf = bytes <= sizeof stack ? stack : malloc(bytes);
    if (!buf) {
        for (int64_t i = 0; i < t * n; i++) y[i] = NAN;
        return;
    }
    int16_t *xq = (int16_t *)buf;
    float *xsc = (float *)(buf + (size_t)(t * nb) * 32 * sizeof(int16_t));
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static) /* ends with a barrier: x is quantized before any row */
        for (int64_t i = 0; i < t * nb; i++) /* block i: token i / nb, columns 32 * (i % nb) */
            quantize_block(x + i / nb * xs + i % nb * 32, xq + 32 * i, xsc + i, deint);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int64_t r1 = (i + 1) * rows < n ? (i + 1) * rows : n;
            for (int64_t r = i * rows; r < r1; r++)
                for (int64_t j = 0; j < t; j++) {
                    const float s = qdot ? qdot(w, r, xq + j * k, xsc + j * nb) : dot(w, r, x + j * xs);
                    y[j * n + r] = bias ? s + bias[r] : s;
                }
        }
    }
    if (buf != stack) free(buf);
}

static void decode(const qweight *w, decode_fn fn, int64_t r0, int64_t r1, float *out, int threads) {
    tables();
    const int64_t n = r1 - r0;
    int nth = threads < n ? threads : (int)n;
    nth = nth < MAX_THREADS ? (nth > 1 ? nth : 1) : MAX_THREADS;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = r0; r < r1; r++) fn(w, r, out + (r - r0) * w->k);
}

/* zllm_qgemv_<layout>(parts..., x, xs, bias | NULL, y, T, N, K, threads): x [T, K] with row
 * stride xs (elements), y [T, N] contiguous. zllm_qdecode_<layout>(parts..., N, K, r0, r1,
 * out, threads): rows [r0, r1) as f32 into out [r1 - r0, K]. int4_g / int8_g / mxfp4 / nvfp4:
 * K a multiple of 32, and the group size g of int4_g / int8_g a multiple of 32 or 16 (the
 * Python side checks). */

void zllm_qgemv_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, const float *x, int64_t xs,
                    const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k};
    gemv(&w, dot_fp8, 0, 0, x, xs, bias, y, t, threads);
}
void zllm_qdecode_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, int64_t n, int64_t k,
                      int64_t r0, int64_t r1, float *out, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k};
    decode(&w, decode_fp8, r0, r1, out, threads);
}

#define INT_ENTRIES(NAME, ROW_BYTES, DEINT)                                                          \
void zllm_qgemv_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,      \
                       const float *x, int64_t xs, const float *bias, float *y, int64_t t,          \
                       int64_t n, int64_t k, int threads) {                                         \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES};                              \
    gemv(&w, 0, dot_##NAME, DEINT, x, xs, bias, y, t, threads);                                               \
}                                                                                                   \
void zllm_qdecode_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,    \
                         int64_t n, int64_t k, int64_t r0, int64_t r1, float *out, int threads) {   \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES};                              \
    decode(&w, decode_##NAME, r0, r1, out, threads);                                                \
}

INT_ENTRIES(int4, k / 2, 1)
INT_ENTRIES(int8, k, 0)

void zllm_qgemv_mxfp4(const uint8_t *q, const uint8_t *scales, const float *x, int64_t xs, const float *bias,
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2};
    gemv(&w, 0, dot_mxfp4, 1, x, xs, bias, y, t, threads);
}
void zllm_qdecode_mxfp4(const uint8_t *q, const uint8_t *scales, int64_t n, int64_t k, int64_t r0, int64_t r1,
                        float *out, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2};
    decode(&w, decode_mxfp4, r0, r1, out, threads);
}

void zllm_qgemv_nvfp4(const uint8_t *q, const uint8_t *scales, float global, const float *x, int64_t xs,
                      const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2};
    gemv(&w, 0, dot_nvfp4, 1, x, xs, bias, y, t, threads);
}
void zllm_qdecode_nvfp4(const uint8_t *q, const uint8_t *scales, float global, int64_t n, int64_t k, int64_t r0,
                        int64_t r1, float *out, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2};
    decode(&w, decode_nvfp4, r0, r1, out, threads);
}
