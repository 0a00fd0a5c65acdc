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
 * Activations are f32, as the reference's (issue #14: a kernel that rounds the activations,
 * as the GGUF GEMV does to int16, differs numerically from dequantize-then-matmul and would
 * be a named variant with its own tolerance). Each 16 columns are decoded exactly into two
 * 8-lane f32 vectors before the group's scale, the scale taking back a folded factor:
 *   E4M3FN: the byte sign-extended to 16 bits, shifted left by 7 and masked with 0xBF80 is
 *     the f16 of the same number times 2^-8 (normal and subnormal alike: the exponent bias
 *     goes from 7 to 15), converted with F16C; factor 2^8. (NaN bytes 0x7F / 0xFF become
 *     480 here: a checkpoint holds no NaN weights; the row decode gives NaN.)
 *   INT4 / INT8: q - zero in int16 lanes, widened to int32 and converted; factor 1.
 *   E2M1: twice its value is an integer (0 1 2 3 4 6 8 12, bit 3 = sign): one byte shuffle
 *     of a 16-entry int8 table per 16 nibbles, widened and converted; factor 1/2.
 * Per scale group the values times x go into two 8-lane accumulators, the group's sum times
 * its scale into an 8-lane row total (one FMA), then a fixed horizontal sum, the scalar tail
 * (the columns of a group past its last 16-column step) and + bias. Groups of 16 or 32
 * columns (MXFP4, NVFP4, small int groups) instead scale each 16 values (the reference's w)
 * and accumulate into four 8-lane accumulators: a per-group sum there made every group a
 * dependent FMA on the row total (NVFP4 at 3.7 G weights/s on one core, 9.5 this way).
 * Against the f32 reference (dequantize, then x @ W^T) only rounding differs; ~1e-6 relative.
 *
 * Nibble rows in 128-column chunks (INT4, MXFP4, NVFP4 where K is a multiple of 128 and the
 * groups are 16, 32, 64 or a multiple of 128 columns; other shapes take the steps above and
 * below): x is rearranged once per call (lanes_x: x[c + 8i + m] at c + 16m + i, per 128
 * columns c; INT4 also each lane's sum of its 8 columns). A chunk's 64 bytes read as 16 int32
 * lanes then hold 8 consecutive columns a lane, and nibble m of every lane is the lanes shifted
 * right by 4m, against 16 consecutive floats of the rearranged x: no unpacking of the nibbles
 * and no shuffle of x (the even / odd kernels below spent a widening and two vpermt2ps per 32
 * columns on it). AVX-512: one vpermps of a 16-entry f32 table per 16 weights. AVX2: two
 * halves of 8 lanes; INT4 q by a mask and a convert, E2M1 by cols16's byte shuffle of the
 * low / high nibbles, byte m / 2 sign-extended and converted. Every lane's 8 columns lie in
 * one scale group: per chunk the lanes' products (m = 0 .. 7) go into per-lane sums, which
 * times the lane's scale go into one row total (INT4: the sum minus the zero point times the
 * lane's x sum first, s (sum q x - z sum x): the zero point once a lane, the rounding relative
 * to sum |q x| rather than sum |(q - z) x|). AVX-512 INT4 in groups of a multiple of 128: the
 * table is the group's (q - z) s (the reference's w) and the products go straight into four
 * accumulators (nibble m into m % 4). Measured (bench/quant_gemv.py --threads 1 --isa
 * avx2,avx512, two runs, ratio to Q4_0 at the same level): AVX-512 INT4 g128 0.73 / 0.89x
 * before, 1.07 / 1.03x after; MXFP4 0.67 / 0.79x -> 1.19 / 1.23x; NVFP4 0.62 / 0.71x -> 1.00 /
 * 1.06x; AVX2 INT4 0.45 / 0.44x -> 0.69 / 0.70x, MXFP4 0.42 / 0.44x -> 0.64 / 0.60x, NVFP4
 * 0.40 / 0.40x -> 0.55 / 0.55x.
 *
 * INT8 rows at AVX-512 with K and the groups multiples of 16 (compressed-tensors W8A16, per
 * channel or in groups): x is copied once per call with each group's sum of x after it
 * (int8_sums_x); per 16 columns the unsigned q are one zero-extension and one conversion (no
 * zero point subtracted), times x into four accumulators (steps j % 4); per group (a0 + a1) +
 * (a2 + a3) minus z times the group's x sum (in lane 0), times the scale into the row total:
 * s (sum q x - z sum x), as the INT4 chunk kernels apply theirs. Three vector operations per 16
 * weights instead of four; measured (bench/quant_gemv.py --threads 1, ratio to Q8_0 at AVX-512)
 * in docs/performance.md. Where K and the groups are multiples of 64, quant_gemv_vnni.c takes
 * INT8 rows first (x as exact int8 digits against the quants by vpdpbusd; gemv_int8). At the AVX2
 * level, INT4 rows with K a multiple of 64 and groups of at least 128 columns (multiples of 64, or
 * one per row) go first to quant_gemv_int4.c (the same digits, quant_digits.c, against the nibbles
 * by vpmaddubsw; gemv_int4): per call 1.45-1.74x the lane kernels' speed at T = 1, 1.07-1.25x
 * at T = 2 (its file comment; bench/quant_gemv.py int4_g / Q4_0 at AVX2 0.63x -> 0.80x). The
 * lane kernels below keep the other INT4 shapes, the tokens the digits cannot hold and the MoE
 * rows (moe.c plans the f32 rows). FP8 keeps
 * its five (sign extension, shift, mask, F16C conversion, FMA): a lookup of 128 magnitudes by vpermi2ps takes four 32-entry lookups per 16 weights.
 *
 * Order: every output element is reduced in an order that depends only on the layout, K, the
 * group size and the ISA level in use (never on T, N, the other rows or the thread split; x's
 * rearrangement depends only on the token's own row): an output row is
 * bit-identical whatever else is in the call.
 *
 * AVX-512 (isa.h; chosen when the library loads where the CPU has it, ZLLM_NATIVE_ISA=avx2
 * forces the AVX2 kernels), rows not in 128-column chunks: the GEMV rows decode each 16 columns into one 16-lane vector (the
 * same exact values; nibbles by one vpermps from a 16-entry f32 table of q - z or E2M1; the
 * group's scale from broadcast loads, no scalar step) and accumulate 16 lanes wide. MXFP4 and
 * INT4 in groups of a multiple of 32: per group the table times the scale (the reference's w
 * of each nibble value), each 32 columns as their even columns (low nibbles) and odd columns
 * (high nibbles), one vpermps each, times x's even / odd columns (vpermt2ps) into two 16-lane
 * accumulators (1.5x the AVX2 kernel's speed; decoding nibbles in column order cost a
 * widening, a shift and an OR per 16). Other groups of 16 or 32: two 16-lane accumulators (the
 * first / second 16 columns of each 32). Then a0 + a1 and a fixed horizontal sum. Larger
 * groups (FP8, INT8): per group two 16-lane accumulators (even / odd 16-column steps of the
 * group; the AVX2 kernel's pair takes columns 0-7 / 8-15 of every step), their sum times the
 * scale into a 16-lane row total, the same scalar tail. So the two levels sum the same f32
 * products (or the same w times x) in different orders: not bit-identical to each other (~1e-6
 * relative apart, both within the tolerance above), each in one fixed order. The row decode
 * for prefill (zllm_qdecode_*) is exact at both levels and stays AVX2.
 *
 * Threads: OpenMP with the caller's thread count (the libgomp torch loaded, as gemv.c). The
 * rows are cut into work items of about CHUNK_BYTES of weights handed out dynamically, so a
 * thread the OS deschedules on a busy machine holds up one item, not a static share (a call
 * under GEMV_PARALLEL_MIN_WORK, common.h, runs on the calling thread alone). Tokens
 * go two at a time through one decode of a row (4 tokens: 1.8x faster than one at a time);
 * T is small here: prefill decodes row tiles with zllm_qdecode_* for torch.mm.
 */
#include "common.h"
#include "isa.h"
#include "quant_digits.h"
#include "quant_gemv.h"
#include "quant_gemv_bf16.h"

#include <stdlib.h>
#include <string.h>


#define CHUNK_BYTES (64 << 10) /* weight bytes per work item */
#define PREFETCH_AHEAD 2048    /* bytes: the decode loops retire few bytes per instruction */


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

/* ---- 16 columns of a row in registers ---- */

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

/* The group's scale s and the scale vs of cols16's values (file comment). */
INLINE void group_scale(const qweight *w, const float *sf, const uint8_t *s8, int64_t gi, const int layout,
                        float *s, float *vs) {
    if (layout == L_FP8) *s = sf[gi], *vs = *s * 256.0f;
    else if (layout == L_INT4 || layout == L_INT8) *s = sf[gi], *vs = *s;
    else if (layout == L_MXFP4) *s = E8M0[s8[gi]], *vs = *s * 0.5f;
    else *s = E4M3[s8[gi]] * w->global, *vs = *s * 0.5f;
}

/* Row r's parts: quants, zero points, f32 or byte scales of its row (fp8: of its row block). */
#define ROW_PARTS(w, r, layout)                                                                 \
    const int64_t k = (w)->k, g = (w)->g, ng = (w)->ng;                                         \
    const uint8_t *row = (w)->q + (r) * (w)->row_bytes;                                         \
    const uint8_t *zr = (w)->zeros ? (w)->zeros + (r) * ng : 0;                                 \
    const uint8_t *s8 = (const uint8_t *)(w)->scales + (r) * ng;                                \
    const float *sf = (const float *)(w)->scales + ((layout) == L_FP8 ? (r) / (w)->bn : (r)) * ng

/* Row r decoded to f32, group by group: each value the reference's one rounding of (exact
 * value) * scale (nvfp4's scale formed first as e4m3 * global, as the reference does); in the
 * vector steps the scaled-down value times the scaled-up scale is the same real product, so
 * the same f32. */
INLINE void decode_row(const qweight *w, int64_t r, float *out, const int layout) {
    ROW_PARTS(w, r, layout);
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        const int z = zr ? zr[gi] : 0;
        float s, vs;
        group_scale(w, sf, s8, gi, layout, &s, &vs);
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

/* Columns [c, c + 32) of a row whose scale groups are 16 or 32 columns (lg = log2(g / 16)):
 * each 16-column step scaled by its own group's scale, then times x into its own pair of
 * accumulators (a[0..1] for the first step, a[2..3] for the second). */
/* Tokens sharing one decode of a weight row (as gemv.c): the row stays in registers for the
 * second token. Each token's accumulators take the same operations in the same order as
 * alone, so results do not depend on the pairing. */
#define TOKENS_MAX 2

/* Columns [c, c + 32) of a row whose scale groups are 16 or 32 columns (lg = log2(g / 16)):
 * each 16-column step scaled by its own group's scale, then times each token's x into that
 * token's pair of accumulators for the step (a[t][0..1] first step, a[t][2..3] second). */
INLINE void steps32(const qweight *w, const uint8_t *row, const uint8_t *zr, const float *sf, const uint8_t *s8,
                    const float *x, int64_t xs, int64_t c, int lg, const int layout, const int TT,
                    __m256 a[TOKENS_MAX][4]) {
    for (int h = 0; h < 2; h++) {
        const int64_t cc = c + 16 * h, gi = cc >> 4 >> lg;
        float s, vs;
        group_scale(w, sf, s8, gi, layout, &s, &vs);
        __m256 lo, hi;
        PREFETCH_ROW(row + (layout == L_INT8 || layout == L_FP8 ? cc : cc / 2));
        cols16(row, cc, zr ? zr[gi] : 0, layout, &lo, &hi);
        const __m256 v = _mm256_set1_ps(vs);
        lo = _mm256_mul_ps(lo, v);
        hi = _mm256_mul_ps(hi, v);
        for (int t = 0; t < TT; t++) {
            a[t][2 * h] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + t * xs + cc), a[t][2 * h]);
            a[t][2 * h + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + t * xs + cc + 8), a[t][2 * h + 1]);
        }
    }
}

/* One row times TT tokens (x rows xs apart; f32 activations) -> y[t]. Groups of 16 or 32
 * columns (MXFP4, NVFP4, small int groups; K a multiple of 32): each 16 decoded values times
 * their scale (the reference's w, rounded once), times x into four 8-lane accumulators. Larger
 * groups: per group the unscaled values times x in two 8-lane accumulators, the group's sum
 * times its scale into an 8-lane row total (one FMA), a group's columns past its last
 * 16-column step one scalar FMA each into a tail. Then a fixed horizontal sum. */
INLINE void dot_row(const qweight *w, int64_t r, const float *x, int64_t xs, float *y, const int layout,
                    const int TT) {
    ROW_PARTS(w, r, layout);
    if ((g == 16 || g == 32) && k % 32 == 0) {
        __m256 a[TOKENS_MAX][4];
        for (int t = 0; t < TT; t++)
            for (int i = 0; i < 4; i++) a[t][i] = _mm256_setzero_ps();
        const int lg = g == 32;
        for (int64_t c = 0; c < k; c += 32) steps32(w, row, zr, sf, s8, x, xs, c, lg, layout, TT, a);
        for (int t = 0; t < TT; t++)
            y[t] = hsum(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][2]), _mm256_add_ps(a[t][1], a[t][3])));
        return;
    }
    const int nibbles = layout == L_INT4 || layout == L_MXFP4 || layout == L_NVFP4;
    __m256 tot[TOKENS_MAX];
    float tail[TOKENS_MAX];
    for (int t = 0; t < TT; t++) tot[t] = _mm256_setzero_ps(), tail[t] = 0.0f;
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        const int z = zr ? zr[gi] : 0;
        float s, vs;
        group_scale(w, sf, s8, gi, layout, &s, &vs);
        __m256 a[TOKENS_MAX][2];
        for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
        int64_t c = gi * g;
        if (!nibbles || c % 2 == 0)
            for (; c + 16 <= c1; c += 16) {
                __m256 lo, hi;
                PREFETCH_ROW(row + (nibbles ? c / 2 : c));
                cols16(row, c, z, layout, &lo, &hi);
                for (int t = 0; t < TT; t++) {
                    a[t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + t * xs + c), a[t][0]);
                    a[t][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + t * xs + c + 8), a[t][1]);
                }
            }
        for (int t = 0; t < TT; t++)
            tot[t] = _mm256_fmadd_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_set1_ps(vs), tot[t]);
        for (; c < c1; c++) {
            const float wc = col1(row, c, z, layout) * s;
            for (int t = 0; t < TT; t++) tail[t] = fmaf(wc, x[t * xs + c], tail[t]);
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum(tot[t]) + tail[t];
}

/* Rows [r0, r1) times all T tokens, pairs of tokens then a last single one -> y [T, N], with
 * DOT (dot_row, or a chunk kernel's dot) for one row and up to TOKENS_MAX tokens. */
#define ROW_KERNEL(NAME, LAYOUT, DOT, ATTR)                                                       \
ATTR static void NAME(const qweight *w, int64_t r0, int64_t r1, const float *x, int64_t xs,     \
                      const float *bias, float *y, int64_t t) {                                \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        float v[TOKENS_MAX];                                                                    \
        int64_t j = 0;                                                                          \
        for (; j + TOKENS_MAX <= t; j += TOKENS_MAX) {                                          \
            DOT(w, r, x + j * xs, xs, v, LAYOUT, TOKENS_MAX);                                   \
            for (int i = 0; i < TOKENS_MAX; i++) y[(j + i) * w->n + r] = bias ? v[i] + bias[r] : v[i]; \
        }                                                                                       \
        if (j < t) {                                                                            \
            DOT(w, r, x + j * xs, xs, v, LAYOUT, 1);                                            \
            y[j * w->n + r] = bias ? v[0] + bias[r] : v[0];                                     \
        }                                                                                       \
    }                                                                                           \
}
#define ROWS(NAME, LAYOUT) ROW_KERNEL(rows_##NAME, LAYOUT, dot_row, )

ROWS(fp8, L_FP8)
ROWS(int4, L_INT4)
ROWS(int8, L_INT8)
ROWS(mxfp4, L_MXFP4)
ROWS(nvfp4, L_NVFP4)

/* ---- nibble rows in 128-column chunks against x rearranged once per call (file comment) ---- */

/* Whether a nibble layout's row takes dot_lanes / dot_lanes_512: K a multiple of 128 and scale
 * groups of 16, 32, 64 or a multiple of 128 columns, so that each lane's 8 columns lie in one
 * group. */
INLINE int lanes_fit(const int layout, int64_t k, int64_t g) {
    if (k % 128 || g <= 0) return 0;
    return layout == L_MXFP4 || layout == L_NVFP4 || (layout == L_INT4 && (g == 16 || g == 32 || g == 64 || g % 128 == 0));
}

/* Whether the lane kernels take x's sums per 8 columns: INT4, whose zero points they apply as
 * z times the sum (AVX-512: only groups under 128 columns; larger ones fold z into the table). */
INLINE int lanes_sums(const int layout, int64_t g) {
    return layout == L_INT4 && (g % 128 || native_isa_level < ISA_AVX512);
}

/* x [T, K] (row stride xs, K a multiple of 128) -> xd [T, xds] in the lane order: per 128
 * columns c, xd[c + 16 m + i] = x[c + 8 i + m] (lane i's column m); with sums, then
 * xd[K + c / 8 + i] = x[c + 8 i] + x[c + 8 i + 1] + ... + x[c + 8 i + 7], added in that order. */
static void lanes_x(const float *x, int64_t xs, int64_t t, int64_t k, int sums, float *xd, int64_t xds) {
    for (int64_t j = 0; j < t; j++)
        for (int64_t c = 0; c < k; c += 128)
            for (int i = 0; i < 16; i++) {
                const float *xi = x + j * xs + c + 8 * i;
                float s = xi[0];
                for (int m = 0; m < 8; m++) {
                    xd[j * xds + c + 16 * m + i] = xi[m];
                    if (m) s += xi[m];
                }
                if (sums) xd[j * xds + k + c / 8 + i] = s;
            }
}

/* Lane i's nibble m (AVX2: lanes i = 8h .. 8h + 7 of a chunk from its h-th 32 bytes) as an
 * exact f32: INT4 q (0 .. 15); E2M1 twice its value, from tl / th, the bytes' low / high
 * nibbles through the 16-entry int8 table (cols16's), byte m / 2 of the lane sign-extended. */
INLINE __m256 nibble8(__m256i v, __m256i tl, __m256i th, int m, const int layout) {
    if (layout == L_INT4) {
        const __m256i q = m ? _mm256_srli_epi32(v, 4 * m) : v;
        return _mm256_cvtepi32_ps(m == 7 ? q : _mm256_and_si256(q, _mm256_set1_epi32(15)));
    }
    const __m256i b = m % 2 ? th : tl;
    const int j = m / 2;
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(j == 3 ? b : _mm256_slli_epi32(b, 24 - 8 * j), 24));
}

/* The scales s[h] of the 8 lanes of half h of the chunk at c for nibble8's values (lane i of
 * the chunk: columns c + 8i .. c + 8i + 7), and INT4's zero points z[h] where zr is not NULL. gi:
 * the chunk's first INT4 group; lg: log2(g / 8) for INT4 groups under 128 columns, 4 for one
 * group a chunk. MXFP4: E8M0 / 2 (exact); NVFP4: e4m3 * global / 2 (lane_scales' product, the
 * same real number halved, rounded once; NaN bytes NaN); INT4: the f32 scales. */
INLINE void lane_scales8(const qweight *w, const float *sf, const uint8_t *s8, const uint8_t *zr, int64_t c,
                         int64_t gi, int lg, const int layout, __m256 s[2], __m256 z[2]) {
    if (layout == L_MXFP4) {
        const uint8_t *b = s8 + c / 32; /* lanes 0-3: b[0], 4-7: b[1], 8-11: b[2], 12-15: b[3] */
        for (int h = 0; h < 2; h++)
            s[h] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(E8M0[b[2 * h]] * 0.5f)),
                                        _mm_set1_ps(E8M0[b[2 * h + 1]] * 0.5f), 1);
        return;
    }
    if (layout == L_NVFP4) { /* lane i: byte i / 2; fp8x16's f16 decode, NaN bytes made f16 NaN */
        const __m128i b = _mm_loadl_epi64((const __m128i *)(s8 + c / 16));
        const __m256i v = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
        const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
        const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80)),
                                          _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
        const __m256 gl = _mm256_set1_ps(w->global * 128.0f); /* (e4m3 2^-8) (global 2^7): e4m3 * global / 2 */
        s[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), gl);
        s[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), gl);
        return;
    }
    if (lg > 3) { /* one group */
        s[0] = s[1] = _mm256_set1_ps(sf[gi]);
        if (zr) z[0] = z[1] = _mm256_set1_ps((float)zr[gi]);
        return;
    }
    /* half h: groups gi + (8h >> lg) .. , lane i of it in group (i >> lg) */
    const __m256i idx = _mm256_srli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lg);
    for (int h = 0; h < 2; h++) {
        const int64_t g0 = gi + (8 * h >> lg);
        __m128 f;
        __m128i zb = _mm_setzero_si128();
        if (lg == 1) {
            f = _mm_loadu_ps(sf + g0);
            if (zr) {
                uint32_t u;
                memcpy(&u, zr + g0, 4);
                zb = _mm_cvtsi32_si128((int)u);
            }
        } else if (lg == 2) {
            f = _mm_castpd_ps(_mm_load_sd((const double *)(sf + g0)));
            if (zr) {
                uint16_t u;
                memcpy(&u, zr + g0, 2);
                zb = _mm_cvtsi32_si128(u);
            }
        } else {
            f = _mm_set1_ps(sf[g0]);
            if (zr) zb = _mm_cvtsi32_si128(zr[g0]);
        }
        s[h] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), idx);
        if (zr) z[h] = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(zb), idx));
    }
}

/* A nibble row (lanes_fit) times TT tokens of lane-ordered x (lanes_x) -> y[t], AVX2: each 128
 * columns as two 32-byte halves of 8 lanes; per half nibble m of every lane (nibble8) times x
 * into one per-half sum (m = 0 .. 7 in order), that sum (INT4: minus the lane's zero point times
 * its x sum) times the lane's scale into one 8-lane total; then the horizontal sum. */
INLINE void dot_lanes(const qweight *w, int64_t r, const float *x, int64_t xs, float *y, const int layout,
                      const int TT) {
    ROW_PARTS(w, r, layout);
    const int lg = layout == L_MXFP4 ? 2 : layout == L_NVFP4 ? 1 : g == 16 ? 1 : g == 32 ? 2 : g == 64 ? 3 : 4;
    const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4,
                                           6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m256 tot[TOKENS_MAX];
    for (int t = 0; t < TT; t++) tot[t] = _mm256_setzero_ps();
    int64_t gi = 0, gend = g; /* INT4 groups of 128 columns or more: the chunk's group */
    for (int64_t c = 0; c < k; c += 128) {
        if (lg > 3 && c == gend) gi++, gend += g;
        PREFETCH_ROW(row + c / 2);
        __m256 s[2], z[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        lane_scales8(w, sf, s8, layout == L_INT4 ? zr : 0, c, lg > 3 ? gi : c >> 3 >> lg, lg, layout, s, z);
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(row + c / 2 + 32 * h));
            __m256i tl = v, th = v;
            if (layout != L_INT4) {
                const __m256i mask = _mm256_set1_epi8(0x0F);
                tl = _mm256_shuffle_epi8(table, _mm256_and_si256(v, mask));
                th = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
            }
            __m256 p[TOKENS_MAX];
            for (int m = 0; m < 8; m++) {
                const __m256 q = nibble8(v, tl, th, m, layout);
                for (int t = 0; t < TT; t++) {
                    const __m256 xv = _mm256_loadu_ps(x + t * xs + c + 16 * m + 8 * h);
                    p[t] = m ? _mm256_fmadd_ps(q, xv, p[t]) : _mm256_mul_ps(q, xv);
                }
            }
            for (int t = 0; t < TT; t++) {
                __m256 sum = p[t];
                if (layout == L_INT4 && zr)
                    sum = _mm256_fnmadd_ps(z[h], _mm256_loadu_ps(x + t * xs + k + c / 8 + 8 * h), sum);
                tot[t] = _mm256_fmadd_ps(sum, s[h], tot[t]);
            }
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum(tot[t]);
}

ROW_KERNEL(lanes_int4, L_INT4, dot_lanes, )
ROW_KERNEL(lanes_mxfp4, L_MXFP4, dot_lanes, )
ROW_KERNEL(lanes_nvfp4, L_NVFP4, dot_lanes, )

/* ---- AVX-512 (isa.h): 16 columns in one 16-lane vector ---- */

/* The 16 nibbles of the 8 bytes at p in column order as the low 4 bits of 16 int32 lanes (the
 * other bits are not cleared: vpermps reads only the low 4): byte j zero-extended into 64-bit
 * lane j is lane 2j = byte j; OR the lane shifted left by 28 puts byte j >> 4 into lane 2j + 1
 * and leaves the low nibble in lane 2j's low bits. */
INLINE AVX512 __m512i nibble_lanes(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    return _mm512_or_si512(v, _mm512_slli_epi64(v, 28));
}

/* The f32 value of each nibble before the scale (q - z; the E2M1 value itself, not cols16's
 * twice it: scale_512 takes no factor), a 16-entry table for vpermps. */
INLINE AVX512 __m512 nibble_table(int z, const int layout) {
    if (layout == L_INT4)
        return _mm512_cvtepi32_ps(_mm512_sub_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(z)));
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
}

/* The scale of group gi for cols16_512's values in all 16 lanes, from broadcast loads (no
 * scalar step): fp8 scale * 2^8, int scale, E8M0, e4m3 * global (the reference's one f32
 * product, lane by lane). Each times a value is the same real product as cols16's value times
 * group_scale's vs, rounded once: the same f32. */
INLINE AVX512 __m512 scale_512(const qweight *w, const float *sf, const uint8_t *s8, int64_t gi, const int layout) {
    if (layout == L_FP8) return _mm512_mul_ps(_mm512_set1_ps(sf[gi]), _mm512_set1_ps(256.0f));
    if (layout == L_INT4 || layout == L_INT8) return _mm512_set1_ps(sf[gi]);
    if (layout == L_MXFP4) return _mm512_set1_ps(E8M0[s8[gi]]);
    return _mm512_mul_ps(_mm512_set1_ps(E4M3[s8[gi]]), _mm512_set1_ps(w->global));
}

/* cols16's values as one 16-lane vector (the same exact values, E2M1 not doubled); nibbles
 * by one table lookup. */
INLINE AVX512 __m512 cols16_512(const uint8_t *row, int64_t c, int z, const int layout) {
    if (layout == L_FP8) {
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + c)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80)));
    }
    if (layout == L_INT8)
        return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c))),
                                                   _mm512_set1_epi32(z)));
    return _mm512_permutexvar_ps(nibble_lanes(row + c / 2), nibble_table(z, layout));
}

INLINE AVX512 float hsum512(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* steps32 with one 16-lane accumulator per step: a[t][0] the first 16 columns, a[t][1] the
 * second. */
INLINE AVX512 void steps32_512(const qweight *w, const uint8_t *row, const uint8_t *zr, const float *sf,
                               const uint8_t *s8, const float *x, int64_t xs, int64_t c, int lg, const int layout,
                               const int TT, __m512 a[TOKENS_MAX][2]) {
    for (int h = 0; h < 2; h++) {
        const int64_t cc = c + 16 * h, gi = cc >> 4 >> lg;
        PREFETCH_ROW(row + (layout == L_INT8 || layout == L_FP8 ? cc : cc / 2));
        const __m512 v = _mm512_mul_ps(cols16_512(row, cc, zr ? zr[gi] : 0, layout), scale_512(w, sf, s8, gi, layout));
        for (int t = 0; t < TT; t++) a[t][h] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * xs + cc), a[t][h]);
    }
}

/* A row of nibbles in scale groups of a multiple of 32 columns (MXFP4, INT4 groups of 32, 64,
 * 128 ...) times TT tokens -> y[t]. Per group the 16-entry table times the group's scale is the
 * reference's w of each nibble value (rounded once); each 32 columns (16 bytes) are 16 lanes of
 * bytes, the low nibbles (even columns) and the high ones (odd columns) each one vpermps of that
 * table, times the even / odd columns of x (two vpermt2ps) into two accumulators. Then a0 + a1
 * and the horizontal sum. */
INLINE AVX512 void dot_nibbles_512(const qweight *w, const uint8_t *row, const uint8_t *zr, const float *sf,
                                   const uint8_t *s8, const float *x, int64_t xs, float *y, const int layout,
                                   const int TT) {
    const int64_t k = w->k, g = w->g, ng = w->ng;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 a[TOKENS_MAX][2];
    for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        const __m512 table = _mm512_mul_ps(nibble_table(zr ? zr[gi] : 0, layout), scale_512(w, sf, s8, gi, layout));
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        for (int64_t c = gi * g; c < c1; c += 32) {
            PREFETCH_ROW(row + c / 2);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
            const __m512 we = _mm512_permutexvar_ps(v, table), wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int t = 0; t < TT; t++) {
                const __m512 x0 = _mm512_loadu_ps(x + t * xs + c), x1 = _mm512_loadu_ps(x + t * xs + c + 16);
                a[t][0] = _mm512_fmadd_ps(we, _mm512_permutex2var_ps(x0, even, x1), a[t][0]);
                a[t][1] = _mm512_fmadd_ps(wo, _mm512_permutex2var_ps(x0, odd, x1), a[t][1]);
            }
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum512(_mm512_add_ps(a[t][0], a[t][1]));
}

/* dot_row with 16-lane vectors (file comment: the AVX-512 order). Groups of 16 or 32: two
 * accumulators (first / second 16 columns of each 32), then a0 + a1 and the horizontal sum.
 * Larger groups: per group the unscaled values times x into two accumulators (even / odd
 * 16-column steps of the group), their sum times the scale into a 16-lane row total, the
 * scalar tail as dot_row's; then the horizontal sum of the total plus the tail. */
INLINE AVX512 void dot_row_512(const qweight *w, int64_t r, const float *x, int64_t xs, float *y, const int layout,
                               const int TT) {
    ROW_PARTS(w, r, layout);
    if ((layout == L_MXFP4 || layout == L_INT4) && g % 32 == 0 && k % 32 == 0) {
        dot_nibbles_512(w, row, zr, sf, s8, x, xs, y, layout, TT);
        return;
    }
    if ((g == 16 || g == 32) && k % 32 == 0) {
        __m512 a[TOKENS_MAX][2];
        for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
        const int lg = g == 32;
        for (int64_t c = 0; c < k; c += 32) steps32_512(w, row, zr, sf, s8, x, xs, c, lg, layout, TT, a);
        for (int t = 0; t < TT; t++) y[t] = hsum512(_mm512_add_ps(a[t][0], a[t][1]));
        return;
    }
    const int nibbles = layout == L_INT4 || layout == L_MXFP4 || layout == L_NVFP4;
    __m512 tot[TOKENS_MAX];
    float tail[TOKENS_MAX];
    for (int t = 0; t < TT; t++) tot[t] = _mm512_setzero_ps(), tail[t] = 0.0f;
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        const int z = zr ? zr[gi] : 0;
        float s, vs;
        group_scale(w, sf, s8, gi, layout, &s, &vs); /* s: the scalar tail's */
        __m512 a[TOKENS_MAX][2];
        for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
        int64_t c = gi * g;
        if (!nibbles || c % 2 == 0) {
            for (; c + 32 <= c1; c += 32) /* constant indices keep a[][] in registers */
                for (int h = 0; h < 2; h++) {
                    PREFETCH_ROW(row + (nibbles ? (c + 16 * h) / 2 : c + 16 * h));
                    const __m512 v = cols16_512(row, c + 16 * h, z, layout);
                    for (int t = 0; t < TT; t++)
                        a[t][h] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * xs + c + 16 * h), a[t][h]);
                }
            if (c + 16 <= c1) {
                const __m512 v = cols16_512(row, c, z, layout);
                for (int t = 0; t < TT; t++) a[t][0] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * xs + c), a[t][0]);
                c += 16;
            }
        }
        for (int t = 0; t < TT; t++)
            tot[t] = _mm512_fmadd_ps(_mm512_add_ps(a[t][0], a[t][1]), scale_512(w, sf, s8, gi, layout), tot[t]);
        for (; c < c1; c++) {
            const float wc = col1(row, c, z, layout) * s;
            for (int t = 0; t < TT; t++) tail[t] = fmaf(wc, x[t * xs + c], tail[t]);
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum512(tot[t]) + tail[t];
}

/* ---- AVX-512, nibble rows in 128-column chunks against x rearranged once per call ---- */

/* The 16 >> lg f32 (the chunk's INT4 scales; lg = log2(g / 8), 1 .. 3) at p in the low lanes, by a
 * load of exactly their size (never past the row's scales); the other lanes are not read by
 * lane_group. */
INLINE AVX512 __m512 chunk_f32(const float *p, int lg) {
    if (lg == 1) return _mm512_castps256_ps512(_mm256_loadu_ps(p));
    if (lg == 2) return _mm512_castps128_ps512(_mm_loadu_ps(p));
    return _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)p)));
}

/* The 16 >> lg bytes at p (a chunk's zero points or scale bytes) zero-extended to the low int32
 * lanes, as chunk_f32. */
INLINE AVX512 __m512i chunk_u8(const uint8_t *p, int lg) {
    if (lg == 1) return _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (lg == 2) {
        uint32_t v;
        memcpy(&v, p, 4);
        return _mm512_cvtepu8_epi32(_mm_cvtsi32_si128((int)v));
    }
    uint16_t v;
    memcpy(&v, p, 2);
    return _mm512_cvtepu8_epi32(_mm_cvtsi32_si128(v));
}

/* The scale of each lane's group for the 128 columns at c (lane i: columns c + 8i .. c + 8i + 7,
 * lane_group[i] = its group's index within the chunk; INT4: gi the chunk's first group, lg =
 * log2(g / 8)): MXFP4 2^(e - 127) from the E8M0 bytes
 * (vscalefps: exact, subnormal and infinite as E8M0[]); NVFP4 e4m3 * global from the F16C
 * decode of fp8x16 (times 2^-8) and global * 2^8, the same real product as E4M3[b] * global,
 * rounded once (NaN bytes NaN, as E4M3[]); INT4 the f32 scales. Only the chunk's own groups'
 * scales are read. */
INLINE AVX512 __m512 lane_scales(const qweight *w, const float *sf, const uint8_t *s8, int64_t c, int64_t gi,
                                 __m512i lane_group, int lg, const int layout) {
    if (layout == L_MXFP4) {
        const __m512 ef = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(lane_group, chunk_u8(s8 + c / 32, 2)));
        return _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_sub_ps(ef, _mm512_set1_ps(127.0f)));
    }
    if (layout == L_NVFP4) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(s8 + c / 16));
        const __m256i v = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b)); /* lane i: byte i / 2 */
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80));
        const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_mul_ps(_mm512_set1_ps(w->global), _mm512_set1_ps(256.0f)));
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
        return _mm512_mask_mov_ps(s, nan, _mm512_set1_ps(NAN));
    }
    return _mm512_permutexvar_ps(lane_group, chunk_f32(sf + gi, lg));
}

/* A nibble row (lanes_fit) times TT tokens of lane-ordered x (lanes_x, token rows xds apart) ->
 * y[t]. Each 128 columns are one 64-byte load; nibble m of every lane is the load shifted
 * right by 4m, one vpermps of a 16-entry table. INT4 in groups of a multiple of 128: the table
 * is the group's (q - z) * s (the reference's w, as dot_nibbles_512), nibble m times x into
 * accumulator m % 4; then (a0 + a1) + (a2 + a3) and the horizontal sum. Smaller groups, MXFP4
 * and NVFP4: the table is the exact value (q, or E2M1), nibbles m times x into two per-chunk
 * sums (m even / odd) per lane, their sum (INT4: minus the lane's zero point times its x sum,
 * so s (q - z) x with the scale factored out) times the lane's scale into one 16-lane total;
 * then the horizontal sum. */
INLINE AVX512 void dot_lanes_512(const qweight *w, int64_t r, const float *x, int64_t xs, float *y, const int layout,
                                 const int TT) {
    ROW_PARTS(w, r, layout);
    const uint8_t *zrow = zr;
    __m512 a[TOKENS_MAX][4];
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < 4; i++) a[t][i] = _mm512_setzero_ps();
    if (layout == L_INT4 && g % 128 == 0) {
        for (int64_t gi = 0; gi < ng; gi++) {
            const __m512 table = _mm512_mul_ps(nibble_table(zrow ? zrow[gi] : 0, layout), scale_512(w, sf, s8, gi, layout));
            for (int64_t c = gi * g; c < (gi + 1) * g; c += 128) {
                PREFETCH_ROW(row + c / 2);
                const __m512i v = _mm512_loadu_si512(row + c / 2);
                for (int m = 0; m < 8; m++) {
                    const __m512 wv = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * m), table);
                    for (int t = 0; t < TT; t++)
                        a[t][m % 4] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + t * xs + c + 16 * m), a[t][m % 4]);
                }
            }
        }
        for (int t = 0; t < TT; t++)
            y[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
        return;
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = layout == L_INT4 ? _mm512_cvtepi32_ps(iota) : nibble_table(0, layout);
    const int lg = layout == L_MXFP4 ? 2 : layout == L_NVFP4 ? 1 : g == 16 ? 1 : g == 32 ? 2 : 3; /* log2(g / 8) */
    const __m512i lane_group = _mm512_srli_epi32(iota, lg);
    for (int64_t c = 0; c < k; c += 128) {
        const int64_t gi = c >> 3 >> lg; /* INT4: the chunk's first group */
        PREFETCH_ROW(row + c / 2);
        const __m512i v = _mm512_loadu_si512(row + c / 2);
        __m512 p[TOKENS_MAX][2];
        for (int m = 0; m < 8; m++) {
            const __m512 wv = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * m), table);
            for (int t = 0; t < TT; t++) {
                const __m512 xv = _mm512_loadu_ps(x + t * xs + c + 16 * m);
                p[t][m % 2] = m < 2 ? _mm512_mul_ps(wv, xv) : _mm512_fmadd_ps(wv, xv, p[t][m % 2]);
            }
        }
        const __m512 s = lane_scales(w, sf, s8, c, gi, lane_group, lg, layout);
        __m512 z = _mm512_setzero_ps();
        if (layout == L_INT4 && zrow)
            z = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
                lane_group, chunk_u8(zrow + gi, lg)));
        for (int t = 0; t < TT; t++) {
            __m512 sum = _mm512_add_ps(p[t][0], p[t][1]);
            if (layout == L_INT4 && zrow) sum = _mm512_fnmadd_ps(z, _mm512_loadu_ps(x + t * xs + k + c / 8), sum);
            a[t][0] = _mm512_fmadd_ps(sum, s, a[t][0]);
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum512(a[t][0]);
}

ROW_KERNEL(lanes512_int4, L_INT4, dot_lanes_512, AVX512)
ROW_KERNEL(lanes512_mxfp4, L_MXFP4, dot_lanes_512, AVX512)
ROW_KERNEL(lanes512_nvfp4, L_NVFP4, dot_lanes_512, AVX512)

#define ROWS512(NAME, LAYOUT)                                                                  \
AVX512 static void rows512_##NAME(const qweight *w, int64_t r0, int64_t r1, const float *x, int64_t xs, \
                                  const float *bias, float *y, int64_t t) {                    \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        float v[TOKENS_MAX];                                                                    \
        int64_t j = 0;                                                                          \
        for (; j + TOKENS_MAX <= t; j += TOKENS_MAX) {                                          \
            dot_row_512(w, r, x + j * xs, xs, v, LAYOUT, TOKENS_MAX);                           \
            for (int i = 0; i < TOKENS_MAX; i++) y[(j + i) * w->n + r] = bias ? v[i] + bias[r] : v[i]; \
        }                                                                                       \
        if (j < t) {                                                                            \
            dot_row_512(w, r, x + j * xs, xs, v, LAYOUT, 1);                                    \
            y[j * w->n + r] = bias ? v[0] + bias[r] : v[0];                                     \
        }                                                                                       \
    }                                                                                           \
}

ROWS512(fp8, L_FP8)
ROWS512(int4, L_INT4)
ROWS512(int8, L_INT8)
ROWS512(mxfp4, L_MXFP4)
ROWS512(nvfp4, L_NVFP4)

/* ---- AVX-512 INT8 rows against x with its group sums (zero points out of the inner loop) ---- */

/* Whether an INT8 row takes dot_int8_512: groups and K multiples of 16 (no scalar tail). */
INLINE int int8_sums_fit(int64_t k, int64_t g) { return native_isa_level >= ISA_AVX512 && k % 16 == 0 && g % 16 == 0; }

/* x [T, K] (row stride xs) -> xd [T, xds]: x, then at K + gi the sum of group gi's columns of x,
 * added in column order. */
static void int8_sums_x(const qweight *w, const float *x, int64_t xs, int64_t t, float *xd, int64_t xds) {
    for (int64_t j = 0; j < t; j++) {
        memcpy(xd + j * xds, x + j * xs, (size_t)w->k * sizeof(float));
        for (int64_t gi = 0; gi < w->ng; gi++) {
            const int64_t c1 = (gi + 1) * w->g < w->k ? (gi + 1) * w->g : w->k;
            float s = 0.0f;
            for (int64_t c = gi * w->g; c < c1; c++) s += x[j * xs + c];
            xd[j * xds + w->k + gi] = s;
        }
    }
}

/* The 16 unsigned bytes at q as f32 times each token's 16 floats at x (rows xs apart) into a[t][h]. */
INLINE AVX512 void u8x16_fma(const uint8_t *q, const float *x, int64_t xs, const int TT, __m512 a[TOKENS_MAX][4],
                             const int h) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)));
    for (int t = 0; t < TT; t++) a[t][h] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * xs), a[t][h]);
}

/* An INT8 row (int8_sums_fit) times TT tokens of x with group sums (int8_sums_x) -> y[t]. Per
 * group the unsigned q (one zero-extension and one conversion per 16 columns, no zero point)
 * times x into four accumulators (16-column steps j % 4), (a0 + a1) + (a2 + a3), minus z times
 * the group's x sum in lane 0 (s (sum q x - z sum x): the zero point once a group, the rounding
 * relative to sum |q x| rather than sum |(q - z) x|, as the INT4 lane kernels), times the scale
 * into a 16-lane row total; then the horizontal sum. */
INLINE AVX512 void dot_int8_512(const qweight *w, int64_t r, const float *x, int64_t xs, float *y, const int layout,
                                const int TT) {
    ROW_PARTS(w, r, layout);
    (void)s8;
    __m512 tot[TOKENS_MAX];
    for (int t = 0; t < TT; t++) tot[t] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c1 = (gi + 1) * g < k ? (gi + 1) * g : k;
        __m512 a[TOKENS_MAX][4];
        for (int t = 0; t < TT; t++)
            for (int h = 0; h < 4; h++) a[t][h] = _mm512_setzero_ps();
        int64_t c = gi * g;
        for (; c + 64 <= c1; c += 64) { /* constant indices keep a[][] in registers */
            PREFETCH_ROW(row + c); /* one cache line */
            for (int h = 0; h < 4; h++) u8x16_fma(row + c + 16 * h, x + c + 16 * h, xs, TT, a, h);
        }
        for (int h = 0; h < 3; h++) /* unrolled: h stays a constant */
            if (c + 16 * h < c1) u8x16_fma(row + c + 16 * h, x + c + 16 * h, xs, TT, a, h);
        const __m512 s = _mm512_set1_ps(sf[gi]);
        const float z = zr ? (float)zr[gi] : 0.0f;
        for (int t = 0; t < TT; t++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3]));
            const __m512 zx = _mm512_set1_ps(z * x[t * xs + k + gi]);
            tot[t] = _mm512_fmadd_ps(_mm512_mask_sub_ps(sum, 1, sum, zx), s, tot[t]);
        }
    }
    for (int t = 0; t < TT; t++) y[t] = hsum512(tot[t]);
}

ROW_KERNEL(sums512_int8, L_INT8, dot_int8_512, AVX512)

static void decode_fp8(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_FP8); }
static void decode_int4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_INT4); }
static void decode_int8(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_INT8); }
static void decode_mxfp4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_MXFP4); }
static void decode_nvfp4(const qweight *w, int64_t r, float *out) { decode_row(w, r, out, L_NVFP4); }

/* ---- the thread split and the entry points ---- */

typedef qrows_fn rows_fn;
typedef void (*decode_fn)(const qweight *w, int64_t r, float *out);

/* The row kernel of the ISA level in use (isa.h). */
#define ROWS_OF(NAME) (native_isa_level >= ISA_AVX512 ? rows512_##NAME : rows_##NAME)
#define LANES_OF(NAME) (native_isa_level >= ISA_AVX512 ? lanes512_##NAME : lanes_##NAME)

/* y = x W^T (+ bias): rows in work items handed out dynamically (file comment). */
static void gemv(const qweight *w, rows_fn rows_of, const float *x, int64_t xs, const float *bias, float *y,
                 int64_t t, int threads) {
    tables();
    const int64_t n = w->n, per = CHUNK_BYTES / (w->row_bytes > 0 ? w->row_bytes : 1);
    const int64_t rows = per > 1 ? per : 1, items = (n + rows - 1) / rows;
    int nth = gemv_team(threads, items, n * w->row_bytes * t);
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; i++)
        rows_of(w, i * rows, (i + 1) * rows < n ? (i + 1) * rows : n, x, xs, bias, y, t);
}

typedef qprep_fn prep_fn; /* x prepared once per call (lanes_x, int8_sums_x) into [T, xds] */

/* The prepared x on the stack up to PREP_STACK_BYTES (T * K up to 6K), else from malloc. */
#define PREP_STACK_BYTES (32 << 10)

/* gemv of rows against x prepared by prep into rows of xds floats (y is NaN if that x cannot be
 * allocated). */
static void gemv_prepared(const qweight *w, rows_fn rows, prep_fn prep, int64_t xds, const float *x, int64_t xs,
                          const float *bias, float *y, int64_t t, int threads) {
    const size_t bytes = (size_t)(t * xds) * sizeof(float);
    _Alignas(64) float stack[PREP_STACK_BYTES / sizeof(float)];
    float *xd = bytes <= sizeof stack ? stack : malloc(bytes);
    if (!xd) {
        for (int64_t i = 0; i < t * w->n; i++) y[i] = NAN;
        return;
    }
    prep(w, x, xs, t, xd, xds);
    gemv(w, rows, xd, xds, bias, y, t, threads);
    if (xd != stack) free(xd);
}

/* lanes_x as a prep_fn: with x's sums per 8 columns where the rows take them (xds > K). */
static void lanes_prep(const qweight *w, const float *x, int64_t xs, int64_t t, float *xd, int64_t xds) {
    lanes_x(x, xs, t, w->k, xds > w->k, xd, xds);
}

/* The dispatch (quant_gemv.h): nibble layouts where lanes_fit take x rearranged once (lanes_x)
 * and the rows of lanes; INT8 at AVX-512 where int8_sums_fit x with its group sums; the others
 * the rows of their layout. */
qgemv_plan qgemv_plan_of(const qweight *w, int layout) {
    tables();
    switch (layout) {
    case L_INT8:
        if (int8_sums_fit(w->k, w->g)) return (qgemv_plan){sums512_int8, int8_sums_x, w->k + w->ng};
        return (qgemv_plan){ROWS_OF(int8), 0, 0};
    case L_INT4:
    case L_MXFP4:
    case L_NVFP4: {
        const rows_fn rows = layout == L_INT4 ? ROWS_OF(int4) : layout == L_MXFP4 ? ROWS_OF(mxfp4) : ROWS_OF(nvfp4);
        if (!lanes_fit(layout, w->k, w->g)) return (qgemv_plan){rows, 0, 0};
        const rows_fn lanes = layout == L_INT4 ? LANES_OF(int4) : layout == L_MXFP4 ? LANES_OF(mxfp4) : LANES_OF(nvfp4);
        return (qgemv_plan){lanes, lanes_prep, w->k + (lanes_sums(layout, w->g) ? w->k / 8 : 0)};
    }
    default:
        return (qgemv_plan){ROWS_OF(fp8), 0, 0};
    }
}

/* gemv by the weight's plan (qgemv_plan_of). */
static void gemv_planned(const qweight *w, int layout, const float *x, int64_t xs, const float *bias, float *y,
                         int64_t t, int threads) {
    const qgemv_plan plan = qgemv_plan_of(w, layout);
    if (plan.prep && t > 0 && w->n > 0) gemv_prepared(w, plan.rows, plan.prep, plan.xds, x, xs, bias, y, t, threads);
    else gemv(w, plan.rows, x, xs, bias, y, t, threads);
}

/* gemv for INT8 without VNNI: the plan's rows (AVX-512 where int8_sums_fit, against x with its
 * group sums). */
static void gemv_int8_f32(const qweight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                          int threads) {
    gemv_planned(w, L_INT8, x, xs, bias, y, t, threads);
}

/* A whole-GEMV kernel against x as integer digits (quant_digits.h): y for
 * the leading tokens whose x the digits hold, their count, or -1 where it does not apply. */
typedef int64_t (*digits_gemv_fn)(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,
                                  const float *x, int64_t xs, const float *bias, float *y, int64_t t, int64_t n,
                                  int64_t k, int threads);
typedef void (*f32_gemv_fn)(const qweight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                            int threads);

/* gemv of an INT weight: the tokens the digits kernel takes through it, each other token (a
 * non-finite or tiny x: quant_digits.c) through the f32 kernels alone, so the kernel of a token
 * depends on its x only. */
static void gemv_digits(const qweight *w, digits_gemv_fn digits, f32_gemv_fn f32, const float *x, int64_t xs,
                        const float *bias, float *y, int64_t t, int threads) {
    int64_t j = 0;
    for (int64_t run; j < t && (run = digits(w->q, w->scales, w->zeros, w->g, x + j * xs, xs, bias, y + j * w->n,
                                             t - j, w->n, w->k, threads)) >= 0;) {
        j += run;
        if (j < t) f32(w, x + j * xs, xs, bias, y + j * w->n, 1, threads), j++;
    }
    if (j < t) f32(w, x + j * xs, xs, bias, y + j * w->n, t - j, threads);
}

/* gemv for INT8: the VNNI kernel at AVX-512 (quant_gemv_vnni.c), else gemv_int8_f32. */
static void gemv_int8(const qweight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                      int threads) {
    gemv_digits(w, int8_vnni_gemv, gemv_int8_f32, x, xs, bias, y, t, threads);
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
 * out, threads): rows [r0, r1) as f32 into out [r1 - r0, K]. Any K and group size. */

void zllm_qgemv_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, const float *x, int64_t xs,
                    const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k, (k + bk - 1) / bk};
    const int bf16 = fp8_bf16_gemv(q, scale, bn, bk, x, xs, bias, y, t, n, k, threads);
    if (bf16 == FP8_BF16_UNFIT) gemv(&w, ROWS_OF(fp8), x, xs, bias, y, t, threads);
    for (int64_t j = 0; bf16 == FP8_BF16_OUT_OF_RANGE && j < t; j++) /* token by token: batch invariance */
        if (fp8_bf16_gemv(q, scale, bn, bk, x + j * xs, xs, bias, y + j * n, 1, n, k, threads) != FP8_BF16_DONE)
            gemv(&w, ROWS_OF(fp8), x + j * xs, xs, bias, y + j * n, 1, threads);
}
void zllm_qdecode_fp8(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, int64_t n, int64_t k,
                      int64_t r0, int64_t r1, float *out, int threads) {
    const qweight w = {q, scale, 0, 0.0f, n, k, bk, bn, k, (k + bk - 1) / bk};
    decode(&w, decode_fp8, r0, r1, out, threads);
}

#define INT_ENTRIES(NAME, GEMV, ROW_BYTES)                                                           \
void zllm_qgemv_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,      \
                       const float *x, int64_t xs, const float *bias, float *y, int64_t t,          \
                       int64_t n, int64_t k, int threads) {                                         \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES, (k + g - 1) / g};             \
    GEMV(&w, x, xs, bias, y, t, threads);                                                           \
}                                                                                                   \
void zllm_qdecode_##NAME(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g,    \
                         int64_t n, int64_t k, int64_t r0, int64_t r1, float *out, int threads) {   \
    const qweight w = {q, scales, zeros, 0.0f, n, k, g, 1, ROW_BYTES, (k + g - 1) / g};             \
    decode(&w, decode_##NAME, r0, r1, out, threads);                                                \
}

/* gemv for INT4 by the weight's plan (the lane kernels where lanes_fit). */
static void gemv_int4_f32(const qweight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                          int threads) {
    gemv_planned(w, L_INT4, x, xs, bias, y, t, threads);
}

/* gemv for INT4: the vpmaddubsw kernel at AVX2 (quant_gemv_int4.c), else gemv_int4_f32. */
static void gemv_int4(const qweight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                      int threads) {
    gemv_digits(w, int4_digits_gemv, gemv_int4_f32, x, xs, bias, y, t, threads);
}

INT_ENTRIES(int4, gemv_int4, k / 2)
INT_ENTRIES(int8, gemv_int8, k)

void zllm_qgemv_mxfp4(const uint8_t *q, const uint8_t *scales, const float *x, int64_t xs, const float *bias,
                      float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2, (k + 31) / 32};
    gemv_planned(&w, L_MXFP4, x, xs, bias, y, t, threads);
}
void zllm_qdecode_mxfp4(const uint8_t *q, const uint8_t *scales, int64_t n, int64_t k, int64_t r0, int64_t r1,
                        float *out, int threads) {
    const qweight w = {q, scales, 0, 0.0f, n, k, 32, 1, k / 2, (k + 31) / 32};
    decode(&w, decode_mxfp4, r0, r1, out, threads);
}

void zllm_qgemv_nvfp4(const uint8_t *q, const uint8_t *scales, float global, const float *x, int64_t xs,
                      const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2, (k + 15) / 16};
    gemv_planned(&w, L_NVFP4, x, xs, bias, y, t, threads);
}
void zllm_qdecode_nvfp4(const uint8_t *q, const uint8_t *scales, float global, int64_t n, int64_t k, int64_t r0,
                        int64_t r1, float *out, int threads) {
    const qweight w = {q, scales, 0, global, n, k, 16, 1, k / 2, (k + 15) / 16};
    decode(&w, decode_nvfp4, r0, r1, out, threads);
}
