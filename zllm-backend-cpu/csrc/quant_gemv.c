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
 *             scale: w = E2M1(nibble) * e4m3(scale) * global.
 *
 * Decoding, in registers, exact:
 *   E4M3FN -> f16 bits: sign << 15 | (byte & 0x7F) << 7 is the same number times 2^-8
 *   (normal and subnormal alike: the exponent bias goes from 7 to 15), converted with F16C;
 *   the 2^8 is folded into the scale. (NaN bytes 0x7F / 0xFF decode to 480: a checkpoint
 *   holds no NaN weights.)
 *   E2M1: twice its value is an integer (0 1 2 3 4 6 8 12, bit 3 = sign): one pshufb of a
 *   16-entry int8 table per 16 nibbles, then int8 -> int32 -> f32; the 1/2 goes into the
 *   scale.
 *   INT4 / INT8: q - zero in int16 lanes (exact), -> int32 -> f32.
 *
 * Numerics: f32 products of exactly decoded quants, summed per scale group (8-lane
 * accumulators, one per half of a 16-column step), each group's sum times its f32 scale
 * added into an 8-lane row total (one FMA), then a fixed horizontal sum, the scalar tail
 * (fp8 blocks not a multiple of 16 wide) and + bias. Against the f32 reference (dequantize,
 * then x @ W^T) only the rounding differs: the reference rounds each w = q * s to f32, the
 * kernel rounds each group's sum before scaling; ~1e-6 relative. The order of every output
 * element depends only on the layout and K (never on T, N, the other rows or the thread
 * split): an output row is bit-identical whatever else is in the call.
 *
 * Threads: OpenMP with the caller's thread count (the libgomp torch loaded, as gemv.c). The
 * rows are cut into work items of about CHUNK_BYTES of weights handed out dynamically, so a
 * thread the OS deschedules on a busy machine holds up one item, not a static share. Each
 * token is multiplied with the row in turn; the row stays in L1 for the next token (T is
 * small here: prefill decodes row tiles with zllm_qdecode_* and multiplies them with torch).
 */
#include "common.h"

#include <string.h>

#define CHUNK_BYTES (64 << 10) /* weight bytes per work item */
#define PREFETCH_AHEAD 1024    /* bytes: the decode loops retire few bytes per instruction */

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
static float E8M0[256];  /* E8M0 byte -> 2^(b - 127) (255 -> NaN) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static void fill_tables(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        E4M3[b] = (b & 0x7F) == 0x7F ? NAN : (b & 0x80 ? -v : v);
        E8M0[b] = b == 255 ? NAN : ldexpf(1.0f, b - 127);
    }
}

static void tables(void) {
    static int done = 0;
    if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) { /* idempotent: racing fills write the same */
        fill_tables();
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
}

/* ---- 16 quants as two 8-lane f32 vectors (lo = columns 0..7, hi = 8..15) ---- */

/* 16 E4M3FN bytes -> their values times 2^-8 (file comment). */
INLINE void fp8x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(v, 8), _mm256_set1_epi16((short)0x8000));
    const __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* 16 int8 lanes -> two 8-lane f32 vectors. */
INLINE void i8x16_f32(__m128i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* 16 int16 lanes -> two 8-lane f32 vectors. */
INLINE void i16x16_f32(__m256i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

/* The 16 nibbles of 8 bytes at p, in column order (low nibble first), as uint8 lanes. */
INLINE __m128i nibbles8(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
}

/* Twice the E2M1 value of each nibble lane, int8. */
INLINE __m128i e2m1x2(__m128i nib) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm_shuffle_epi8(table, nib);
}

/* q - z for 16 int4 columns (8 bytes at p) and 16 int8 columns (16 bytes), int16 lanes. */
INLINE __m256i int4x16(const uint8_t *p, __m256i z) { return _mm256_sub_epi16(_mm256_cvtepu8_epi16(nibbles8(p)), z); }
INLINE __m256i int8x16(const uint8_t *p, __m256i z) {
    return _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), z);
}

/* ---- 16 columns starting at column c of row `row`, as f32 without the group scale ---- */

INLINE void cols16_fp8(const uint8_t *row, int64_t c, __m256 *lo, __m256 *hi) { fp8x16(row + c, lo, hi); }
INLINE void cols16_int4(const uint8_t *row, int64_t c, __m256i z, __m256 *lo, __m256 *hi) {
    i16x16_f32(int4x16(row + c / 2, z), lo, hi);
}
INLINE void cols16_int8(const uint8_t *row, int64_t c, __m256i z, __m256 *lo, __m256 *hi) {
    i16x16_f32(int8x16(row + c, z), lo, hi);
}
INLINE void cols16_fp4(const uint8_t *row, int64_t c, __m256 *lo, __m256 *hi) {
    i8x16_f32(e2m1x2(nibbles8(row + c / 2)), lo, hi);
}

#define PREFETCH_ROW(p) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T0)

/* ---- one row times one token: per group, sum q * x (unscaled), then * the group's scale ---- */

/* Group loop shared by the formats: STEP16(c, lo, hi) decodes columns c..c+15 of the group;
 * GROUP_SCALE is the group's f32 scale (with the decode's folded factor); the columns of a
 * group are a multiple of 16 (fp8: the tail of each block goes through TAIL(c)). */
#define ROW_DOT(GROUP_COLS, GROUP_SETUP, STEP16, GROUP_SCALE, TAIL)                    \
    __m256 tot = _mm256_setzero_ps();                                                           \
    float tail = 0.0f;                                                                          \
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += (GROUP_COLS), gi++) {                            \
        const int64_t g1 = g0 + (GROUP_COLS) < k ? g0 + (GROUP_COLS) : k;                       \
        GROUP_SETUP;                                                                            \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                              \
        int64_t c = g0;                                                                         \
        for (; c + 16 <= g1; c += 16) {                                                         \
            __m256 lo, hi;                                                                      \
            STEP16;                                                                             \
            a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + c), a0);                               \
            a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + c + 8), a1);                           \
        }                                                                                       \
        const float s = (GROUP_SCALE);                                                          \
        tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(s), tot);                   \
        for (; c < g1; c++) tail = fmaf(TAIL, x[c], tail);                                      \
    }                                                                                           \
    return hsum(tot) + tail;

static float dot_fp8(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k, sk = (k + w->g - 1) / w->g;
    const uint8_t *row = w->q + r * w->row_bytes;
    const float *sc = (const float *)w->scales + r / w->bn * sk;
    ROW_DOT(w->g, (void)0,
            (PREFETCH_ROW(row + c), cols16_fp8(row, c, &lo, &hi)),
            sc[gi] * 256.0f, E4M3[row[c]] * sc[gi])
}

static float dot_int4(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k, ng = k / w->g;
    const uint8_t *row = w->q + r * w->row_bytes, *zr = w->zeros + r * ng;
    const float *sc = (const float *)w->scales + r * ng;
    ROW_DOT(w->g, const __m256i z = _mm256_set1_epi16(zr[gi]),
            (PREFETCH_ROW(row + c / 2), cols16_int4(row, c, z, &lo, &hi)), sc[gi], 0.0f)
}

static float dot_int8(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k, ng = k / w->g;
    const uint8_t *row = w->q + r * w->row_bytes, *zr = w->zeros + r * ng;
    const float *sc = (const float *)w->scales + r * ng;
    ROW_DOT(w->g, const __m256i z = _mm256_set1_epi16(zr[gi]),
            (PREFETCH_ROW(row + c), cols16_int8(row, c, z, &lo, &hi)), sc[gi], 0.0f)
}

static float dot_mxfp4(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k;
    const uint8_t *row = w->q + r * w->row_bytes, *sc = (const uint8_t *)w->scales + r * (k / 32);
    ROW_DOT(32, (void)0, (PREFETCH_ROW(row + c / 2), cols16_fp4(row, c, &lo, &hi)),
            E8M0[sc[gi]] * 0.5f, 0.0f)
}

static float dot_nvfp4(const qweight *w, int64_t r, const float *x) {
    const int64_t k = w->k;
    const uint8_t *row = w->q + r * w->row_bytes, *sc = (const uint8_t *)w->scales + r * (k / 16);
    const float global = w->global * 0.5f; /* exact: the 1/2 of the doubled E2M1 values */
    ROW_DOT(16, (void)0, (PREFETCH_ROW(row + c / 2), cols16_fp4(row, c, &lo, &hi)),
            E4M3[sc[gi]] * global, 0.0f)
}

/* ---- one row decoded to f32 (the reference's value: one rounding of quant * scale) ---- */

static void decode_fp8(const qweight *w, int64_t r, float *out) {
    const int64_t k = w->k, sk = (k + w->g - 1) / w->g;
    const uint8_t *row = w->q + r * w->row_bytes;
    const float *sc = (const float *)w->scales + r / w->bn * sk;
    for (int64_t c = 0; c < k; c++) out[c] = E4M3[row[c]] * sc[c / w->g];
}

static void decode_int4(const qweight *w, int64_t r, float *out) {
    const int64_t k = w->k, ng = k / w->g;
    const uint8_t *row = w->q + r * w->row_bytes, *zr = w->zeros + r * ng;
    const float *sc = (const float *)w->scales + r * ng;
    for (int64_t c = 0; c < k; c++) {
        const int q = c & 1 ? row[c / 2] >> 4 : row[c / 2] & 15;
        out[c] = sc[c / w->g] * (float)(q - zr[c / w->g]);
    }
}

static void decode_int8(const qweight *w, int64_t r, float *out) {
    const int64_t k = w->k, ng = k / w->g;
    const uint8_t *row = w->q + r * w->row_bytes, *zr = w->zeros + r * ng;
    const float *sc = (const float *)w->scales + r * ng;
    for (int64_t c = 0; c < k; c++) out[c] = sc[c / w->g] * (float)(row[c] - zr[c / w->g]);
}

static void decode_mxfp4(const qweight *w, int64_t r, float *out) {
    const int64_t k = w->k;
    const uint8_t *row = w->q + r * w->row_bytes, *sc = (const uint8_t *)w->scales + r * (k / 32);
    for (int64_t c = 0; c < k; c++) out[c] = E2M1[c & 1 ? row[c / 2] >> 4 : row[c / 2] & 15] * E8M0[sc[c / 32]];
}

static void decode_nvfp4(const qweight *w, int64_t r, float *out) {
    const int64_t k = w->k;
    const uint8_t *row = w->q + r * w->row_bytes, *sc = (const uint8_t *)w->scales + r * (k / 16);
    for (int64_t c = 0; c < k; c++)
        out[c] = E2M1[c & 1 ? row[c / 2] >> 4 : row[c / 2] & 15] * E4M3[sc[c / 16]] * w->global;
}

/* ---- the thread split and the entry points ---- */

typedef float (*dot_fn)(const qweight *w, int64_t r, const float *x);
typedef void (*decode_fn)(const qweight *w, int64_t r, float *out);

static void gemv(const qweight *w, dot_fn dot, const float *x, int64_t xs, const float *bias, float *y,
                 int64_t t, int threads) {
    tables();
    const int64_t n = w->n, per = CHUNK_BYTES / (w->row_bytes > 0 ? w->row_bytes : 1);
    const int64_t rows = per > 1 ? per : 1, items = (n + rows - 1) / rows;
    int nth = threads < items ? threads : (int)items;
    nth = nth < MAX_THREADS ? (nth > 1 ? nth : 1) : MAX_THREADS;
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; i++) {
        const int64_t r1 = (i + 1) * rows < n ? (i + 1) * rows : n;
        for (int64_t r = i * rows; r < r1; r++)
            for (int64_t j = 0; j < t; j++) {
                const float s = dot(w, r, x + j * xs);
                y[j * n + r] = bias ? s + bias[r] : s;
            }
    }
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
 * out, threads): rows [r0, r1) as f32 into out [r1 - r0, K]. The group / block columns
 * (g, bk) of int4_g / int8_g are a multiple of 16 (the Python side checks). */

void zllm_qgemv_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, const float *x, int64_t xs,
                    const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k};
    gemv(&w, dot_fp8, x, xs, bias, y, t, threads);
}
void zllm_qdecode_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, int64_t n, int64_t k,
                      int64_t r0, int64_t r1, float *out, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k};
    decode(&w, decode_fp8, r0, r1, out, threads);
}

#define INT_ENTRIES(NAME, ROW_BYTES)                                                            \
void zllm_qgemv_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,      \
                       const float *x, int64_t xs, const float *bias, float *y, int64_t t,          \
                       int64_t n, int64_t k, int threads) {                                         \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES};                              \
    gemv(&w, dot_##NAME, x, xs, bias, y, t, threads);                                               \
}                                                                                                   \
void zllm_qdecode_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,    \
                         int64_t n, int64_t k, int64_t r0, int64_t r1, float *out, int threads) {   \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES};                              \
    decode(&w, decode_##NAME, r0, r1, out, threads);                                                \
}

INT_ENTRIES(int4, k / 2)
INT_ENTRIES(int8, k)

void zllm_qgemv_mxfp4(const uint8_t *q, const uint8_t *scales, const float *x, int64_t xs, const float *bias,
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2};
    gemv(&w, dot_mxfp4, x, xs, bias, y, t, threads);
}
void zllm_qdecode_mxfp4(const uint8_t *q, const uint8_t *scales, int64_t n, int64_t k, int64_t r0, int64_t r1,
                        float *out, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2};
    decode(&w, decode_mxfp4, r0, r1, out, threads);
}

void zllm_qgemv_nvfp4(const uint8_t *q, const uint8_t *scales, float global, const float *x, int64_t xs,
                      const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2};
    gemv(&w, dot_nvfp4, x, xs, bias, y, t, threads);
}
void zllm_qdecode_nvfp4(const uint8_t *q, const uint8_t *scales, float global, int64_t n, int64_t k, int64_t r0,
                        int64_t r1, float *out, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2};
    decode(&w, decode_nvfp4, r0, r1, out, threads);
}
