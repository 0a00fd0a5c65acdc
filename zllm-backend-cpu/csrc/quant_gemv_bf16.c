/* FP8 E4M3 GEMV rows through AVX-512 BF16 dot products (vdpbf16ps), for CPUs with avx512_bf16
 * and avx512_vbmi (isa.h: native_fp8_bf16): y[T, N] = x[T, K] @ W[N, K]^T (+ bias), x and y f32,
 * w[n, k] = e4m3(q[n, k]) * scale[n / bn, k / bk] (quant_gemv.c's fp8_e4m3 layout; issue #14).
 *
 * Activations stay f32-exact: each token's x is split once per call (fp8_bf16_pieces) into three
 * bf16 pieces, x 2^s = hi + mid + lo exactly (hi = RNE bf16(x 2^s), mid = RNE bf16(x 2^s - hi),
 * lo = x 2^s - hi - mid: 8 + 8 + 8 significant bits, each remainder at most half an ulp of the
 * piece before it, so lo needs no rounding). The weights become bf16 exactly: E4M3 has 4
 * significant bits and exponents 2^-9 .. 2^8, all normal bf16 numbers. The decode is a lookup:
 * per 64 weights two vpermi2b of 128-entry byte tables (the low and the high byte of the bf16
 * of the 7 magnitude bits; NaN bytes 0x7F / 0xFF give a bf16 NaN, as the reference), the sign
 * ORed into the high byte (one vpternlogd), and two byte unpacks into 16-bit lanes (vpunpck{l,h}bw:
 * per 128-bit lane l, columns 16l .. 16l + 7 and 16l + 8 .. 16l + 15; x's pieces are stored in
 * that order, A then B per 64 columns), then six vdpbf16ps per token: 11 vector operations per
 * 64 weights where quant_gemv.c's f32 rows take 20 (five per 16: sign extension, shift, mask,
 * F16C conversion, FMA). The pieces are 6 bytes a column against x's 4, so one row at a time
 * the loads bound both kernels alike (7 loads per 64 weights here, 8 there: measured no
 * faster); a single token's pieces are therefore loaded once for ROWS_ONE rows (3 loads per
 * 64 weights and row), a pair of tokens' once for ROWS_PAIR rows. Measured per call, one
 * thread, against the f32 rows (docs/performance.md): one token 1.28-1.36x, token pairs
 * 0.89-1.04x (the f32 rows already share each decode between the pair). The shorter decode (the byte
 * sign-extended, shifted left by 4 and masked with 0x87F0 is the bf16 of the value times
 * 2^-120; measured no faster either) is not taken: vdpbf16ps reads bf16 subnormal inputs as
 * zero (DAZ, measured on Zen 5), and it makes the 14 nonzero E4M3 subnormals (|w| < 2^-6)
 * bf16 subnormals, so they would be dropped.
 *
 * Range (fp8_bf16_pieces checks it per token, the call goes to the f32 rows where it fails):
 * vdpbf16ps also flushes subnormal results (FTZ). s = -e where max |x| < 2^e (frexp), so
 * |x 2^s| < 1 (scalefps: exact); every nonzero |x| must be at least 2^(e - 94) (no f32
 * subnormal, NaN or infinity in x), so every piece's lowest bit is at least 2^-117 and every
 * product piece * E4M3 (lowest bit at least 2^-9) is a nonzero multiple of 2^-126 or zero:
 * exact in f32, and so is every partial sum's exact value, which rounds to a normal number or
 * to zero (never to a subnormal one). Sums stay below 448 K (no overflow for K < 2^31 and
 * scales below 2^87).
 *
 * Numerics against the f32 rows and the reference (dequantize, then x @ W^T): the same exact
 * products w x, now as three products per column (w hi, w mid, w lo), each exact, summed in f32
 * with rounding after each addition (vdpbf16ps: the two products of a lane added one after the
 * other to the accumulator, round to nearest even) into three accumulators per row and token
 * (the hi, mid and lo products; per 64 columns the A columns, then the B columns), per scale
 * group (a_hi + a_mid) + a_lo times the scale into a 16-lane row total (one FMA), a fixed
 * horizontal sum, times 2^-s (exact unless y is subnormal) and + bias. So only the rounding
 * differs: 3K rounded additions where the f32 rows have K (the extra ones add the small mid /
 * lo products to their own sums), ~1e-7 relative measured, within the tolerance of
 * quant_gemv.c's rows. The one other difference: an E4M3 NaN byte gives NaN here as in the
 * reference (the f32 rows read it as 480; a checkpoint holds none).
 *
 * Order: every output element is reduced in an order that depends only on K and bk (never on
 * T, N, the other rows, the other tokens or the thread split); s and the pieces depend only on
 * the token's own x. A token whose x fails the range check takes the f32 rows on its own
 * (quant_gemv.c, token by token), so a row's result never depends on the other tokens.
 *
 * Shapes: bk a multiple of 64 (DeepSeek-V3's 128 x 128 blocks) or bk >= K (per channel, per
 * tensor), any K (the last 64 columns of a row by a masked load, x's pieces zero past K), any
 * bn; other block widths take the f32 rows.
 */
#include "common.h"
#include "isa.h"
#include "quant_gemv_bf16.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK_BYTES (64 << 10) /* weight bytes per work item, as quant_gemv.c */
#define PREFETCH_BYTES 8192    /* at least this far ahead, in whole groups of rows (dot_rows) */
#define ROWS_ONE 3             /* rows sharing each load of a single token's pieces */
#define ROWS_PAIR 2            /* rows sharing each load of a pair of tokens' pieces */
#define J_MAX 4                /* (row, token) dot products at once: ROWS_ONE, 2 ROWS_PAIR at most */
#define PIECES_STACK_BYTES (32 << 10)
#define PIECE_WORDS 192        /* bf16 words of x's pieces per 64 columns: hi A, hi B, mid A, mid B, lo A, lo B */
#define MIN_EXP_BELOW_MAX 93   /* frexp exponents: min's >= max's - 93 makes nonzero |x| >= 2^(e - 94) */

/* The low / high byte of the bf16 of each E4M3 magnitude (the byte's 7 low bits), filled once. */
static _Alignas(64) uint8_t BF16_LO[128];
static _Alignas(64) uint8_t BF16_HI[128];

static void fill_tables(void) {
    for (int b = 0; b < 128; b++) {
        const int e = b >> 3, m = b & 7;
        const float v = b == 0x7F ? NAN : e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        uint32_t u;
        memcpy(&u, &v, 4); /* exact in bf16: the low 16 bits are zero (NaN: 0x7FC00000) */
        BF16_LO[b] = (uint8_t)(u >> 16);
        BF16_HI[b] = (uint8_t)(u >> 24);
    }
}

static void tables(void) {
    static int done = 0;
    if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) { /* idempotent: racing fills write the same */
        fill_tables();
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
}

INLINE AVX512_BF16 __m512bh as_bh(__m512i v) { return (__m512bh)v; }

INLINE AVX512_BF16 float hsum16(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* ---- x's pieces, once per call ---- */

/* 16 f32 -> their RNE bf16 (16-bit lanes) and those bf16 as f32. */
INLINE AVX512_BF16 __m256i bf16_of(__m512 v, __m512 *back) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    *back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return h;
}

/* Four 16-column vectors of one piece (natural order) -> its A / B halves (file comment). */
INLINE AVX512_BF16 void store_ab(const __m256i v[4], uint16_t *p) {
    const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(v[0], v[1], 0x20)),
                                         _mm256_permute2x128_si256(v[2], v[3], 0x20), 1);
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(v[0], v[1], 0x31)),
                                         _mm256_permute2x128_si256(v[2], v[3], 0x31), 1);
    _mm512_store_si512(p, a);
    _mm512_store_si512(p + 32, b);
}

INLINE AVX512_BF16 __mmask16 tail16(int64_t c, int64_t k) {
    return c + 16 <= k ? (__mmask16)0xFFFF : c >= k ? 0 : (__mmask16)((1u << (k - c)) - 1);
}

/* One token's x [K] -> its pieces xp [ceil(K / 64) * PIECE_WORDS] (64-byte aligned) and the
 * exponent s (x 2^s = hi + mid + lo); 0 where x is out of range (file comment), else 1. */
static AVX512_BF16 int fp8_bf16_pieces(const float *x, int64_t k, uint16_t *xp, int *s) {
    __m512 vmax = _mm512_setzero_ps(), vmin = _mm512_set1_ps(INFINITY);
    __mmask16 unusable = 0;
    for (int64_t c = 0; c < k; c += 16) {
        const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(tail16(c, k), x + c));
        unusable |= _mm512_fpclass_ps_mask(v, 0x01 | 0x08 | 0x20 | 0x80); /* NaN, infinity, subnormal */
        vmax = _mm512_max_ps(vmax, v);
        vmin = _mm512_mask_min_ps(vmin, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_OQ), vmin, v);
    }
    if (unusable) return 0;
    const float mx = _mm512_reduce_max_ps(vmax), mn = _mm512_reduce_min_ps(vmin);
    int e = 0, emin = 0;
    if (mx > 0.0f) {
        frexpf(mx, &e);
        frexpf(mn, &emin);
        if (emin < e - MIN_EXP_BELOW_MAX) return 0;
    }
    *s = -e;
    const __m512 sv = _mm512_set1_ps((float)-e);
    for (int64_t c = 0; c < k; c += 64, xp += PIECE_WORDS) {
        __m256i hi[4], mid[4], lo[4];
        for (int j = 0; j < 4; j++) {
            const __m512 v = _mm512_scalef_ps(_mm512_maskz_loadu_ps(tail16(c + 16 * j, k), x + c + 16 * j), sv);
            __m512 h, m, unused;
            hi[j] = bf16_of(v, &h);
            const __m512 r = _mm512_sub_ps(v, h);
            mid[j] = bf16_of(r, &m);
            lo[j] = bf16_of(_mm512_sub_ps(r, m), &unused);
        }
        store_ab(hi, xp);
        store_ab(mid, xp + 64);
        store_ab(lo, xp + 128);
    }
    return 1;
}

/* ---- the rows ---- */

typedef struct {
    const uint8_t *q;
    const float *scale;
    int64_t n, k, bn, bk, ng; /* ng: scale columns, ceil(K / bk) */
} fp8_weight;

/* The bf16 of the 64 E4M3 bytes at p (m: the bytes to read, the others 0) as two vectors of 32
 * (file comment: A, B), by the 128-entry tables of their low / high bytes (tlo, thi). */
INLINE AVX512_BF16 void fp8x64(const uint8_t *p, __mmask64 m, const __m512i tlo[2], const __m512i thi[2],
                               __m512i *wa, __m512i *wb) {
    const __m512i q = m == ~0ull ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(m, p);
    const __m512i lo = _mm512_permutex2var_epi8(tlo[0], q, tlo[1]);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(thi[0], q, thi[1]), q,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (q & sign) */
    *wa = _mm512_unpacklo_epi8(lo, hi);
    *wb = _mm512_unpackhi_epi8(lo, hi);
}

/* RR rows from r times TT tokens' pieces (xp, token rows xps words apart; exponents s) -> y[i *
 * TT + t] for row r + i, RR * TT <= 2 (file comment: six accumulators per row and token, per
 * scale group their sum times the scale into a row total). Two rows share each load of a
 * token's pieces, two tokens each decode of a row: the same operations per row and token
 * either way, so the same bits. */
INLINE AVX512_BF16 void dot_rows(const fp8_weight *w, int64_t r, const uint16_t *xp, int64_t xps, const int *s,
                                 float *y, const int RR, const int TT) {
    const int64_t k = w->k, g = w->bk < k ? w->bk : k;
    const uint8_t *row[J_MAX];
    const float *sf[J_MAX];
    for (int i = 0; i < RR; i++) row[i] = w->q + (r + i) * k, sf[i] = w->scale + (r + i) / w->bn * w->ng;
    /* The same columns of the rows RR * m on (whole groups of rows, never the rows being read:
     * prefetching within them, as quant_gemv.c's fixed distance does, made three rows at a time
     * slower than one from memory). */
    const int64_t ahead = RR * k * ((PREFETCH_BYTES + RR * k - 1) / (RR * k));
    const __m512i tlo[2] = {_mm512_load_si512(BF16_LO), _mm512_load_si512(BF16_LO + 64)};
    const __m512i thi[2] = {_mm512_load_si512(BF16_HI), _mm512_load_si512(BF16_HI + 64)};
    __m512 tot[J_MAX];
    for (int j = 0; j < RR * TT; j++) tot[j] = _mm512_setzero_ps();
    for (int64_t c0 = 0, gi = 0; c0 < k; c0 += g, gi++) {
        const int64_t c1 = c0 + g < k ? c0 + g : k;
        __m512 a[J_MAX][3]; /* the hi, mid, lo products */
        for (int j = 0; j < RR * TT; j++)
            for (int i = 0; i < 3; i++) a[j][i] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c1; c += 64) {
            const __mmask64 m = c + 64 <= c1 ? ~0ull : ~0ull >> (64 - (c1 - c));
            __m512i wv[J_MAX][2];
            for (int ri = 0; ri < RR; ri++) {
                _mm_prefetch((const char *)(row[ri] + c) + ahead, _MM_HINT_T0);
                fp8x64(row[ri] + c, m, tlo, thi, &wv[ri][0], &wv[ri][1]);
            }
            for (int t = 0; t < TT; t++) {
                const uint16_t *p = xp + t * xps + c / 64 * PIECE_WORDS;
                for (int i = 0; i < 6; i++) {
                    const __m512bh xv = as_bh(_mm512_load_si512(p + 32 * i));
                    for (int ri = 0; ri < RR; ri++) {
                        __m512 *acc = &a[ri * TT + t][i / 2];
                        *acc = _mm512_dpbf16_ps(*acc, as_bh(wv[ri][i % 2]), xv);
                    }
                }
            }
        }
        for (int ri = 0; ri < RR; ri++) {
            const __m512 sc = _mm512_set1_ps(sf[ri][gi]);
            for (int t = 0; t < TT; t++) {
                const __m512 *v = a[ri * TT + t];
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(v[0], v[1]), v[2]);
                tot[ri * TT + t] = _mm512_fmadd_ps(sum, sc, tot[ri * TT + t]);
            }
        }
    }
    for (int ri = 0; ri < RR; ri++)
        for (int t = 0; t < TT; t++) y[ri * TT + t] = ldexpf(hsum16(tot[ri * TT + t]), -s[t]);
}

/* Rows [r0, r1) times TT tokens from token j -> y [T, N], RR rows at a time, then one by one. */
INLINE AVX512_BF16 void rows_of_tokens(const fp8_weight *w, int64_t r0, int64_t r1, const uint16_t *xp, int64_t xps,
                                       const int *s, const float *bias, float *y, int64_t j, const int RR,
                                       const int TT) {
    float v[J_MAX];
    int64_t r = r0;
    for (; r + RR <= r1; r += RR) {
        dot_rows(w, r, xp + j * xps, xps, s + j, v, RR, TT);
        for (int ri = 0; ri < RR; ri++)
            for (int t = 0; t < TT; t++) y[(j + t) * w->n + r + ri] = bias ? v[ri * TT + t] + bias[r + ri] : v[ri * TT + t];
    }
    for (; r < r1; r++) {
        dot_rows(w, r, xp + j * xps, xps, s + j, v, 1, TT);
        for (int t = 0; t < TT; t++) y[(j + t) * w->n + r] = bias ? v[t] + bias[r] : v[t];
    }
}

/* Rows [r0, r1) times all T tokens -> y [T, N]: tokens two at a time through ROWS_PAIR rows at a
 * time, a last single token through ROWS_ONE rows at a time. */
static AVX512_BF16 void rows(const fp8_weight *w, int64_t r0, int64_t r1, const uint16_t *xp, int64_t xps,
                             const int *s, const float *bias, float *y, int64_t t) {
    int64_t j = 0;
    for (; j + 2 <= t; j += 2) rows_of_tokens(w, r0, r1, xp, xps, s, bias, y, j, ROWS_PAIR, 2);
    if (j < t) rows_of_tokens(w, r0, r1, xp, xps, s, bias, y, j, ROWS_ONE, 1);
}

/* The pieces of all T tokens, then the rows in work items handed out dynamically (as quant_gemv.c's
 * gemv); FP8_BF16_OUT_OF_RANGE before any row where some token's x fails the range check. */
static AVX512_BF16 int gemv(const fp8_weight *w, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                            int threads) {
    const int64_t xps = (w->k + 63) / 64 * PIECE_WORDS;
    const size_t bytes = (size_t)(t * xps) * sizeof(uint16_t) + (size_t)t * sizeof(int);
    _Alignas(64) uint16_t stack[PIECES_STACK_BYTES / sizeof(uint16_t)];
    uint16_t *xp = bytes <= sizeof stack ? stack : aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!xp) {
        for (int64_t i = 0; i < t * w->n; i++) y[i] = NAN;
        return FP8_BF16_DONE;
    }
    int *s = (int *)(xp + t * xps);
    for (int64_t j = 0; j < t; j++)
        if (!fp8_bf16_pieces(x + j * xs, w->k, xp + j * xps, s + j)) {
            if (xp != stack) free(xp);
            return FP8_BF16_OUT_OF_RANGE;
        }
    const int64_t n = w->n, per = CHUNK_BYTES / w->k;
    const int64_t rows_per = per > 1 ? per : 1, items = (n + rows_per - 1) / rows_per;
    int nth = gemv_team(threads, items, n * w->k * t);
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; i++)
        rows(w, i * rows_per, (i + 1) * rows_per < n ? (i + 1) * rows_per : n, xp, xps, s, bias, y, t);
    if (xp != stack) free(xp);
    return FP8_BF16_DONE;
}

static int fp8_bf16_fits(int64_t k, int64_t bk) { return native_fp8_bf16 && k > 0 && (bk % 64 == 0 || bk >= k); }

int fp8_bf16_gemv(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, const float *x, int64_t xs,
                  const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    if (!fp8_bf16_fits(k, bk)) return FP8_BF16_UNFIT;
    if (t <= 0 || n <= 0) return FP8_BF16_DONE;
    tables();
    const fp8_weight w = {q, scale, n, k, bn, bk, (k + bk - 1) / bk};
    return gemv(&w, x, xs, bias, y, t, threads);
}

/* The bf16 of every E4M3 byte as the rows decode it, for the tests: out [256]. */
void zllm_fp8_bf16_decode_table(uint16_t *out) {
    tables();
    for (int b = 0; b < 256; b++) out[b] = (uint16_t)(BF16_LO[b & 0x7F] | (BF16_HI[b & 0x7F] | (b & 0x80)) << 8);
}

/* x [T, K] -> each token's pieces hi, mid, lo [T, 3, K] (bf16 bits, column order) and exponent
 * s [T] as the rows use them, for the tests; returns 0 where some token is out of range. */
int zllm_fp8_bf16_split(const float *x, int64_t t, int64_t k, uint16_t *pieces, int32_t *s) {
    if (!native_fp8_bf16) return 0;
    const int64_t xps = (k + 63) / 64 * PIECE_WORDS;
    uint16_t *xp = aligned_alloc(64, (size_t)xps * sizeof(uint16_t));
    if (!xp) return 0;
    int ok = 1;
    for (int64_t j = 0; j < t && ok; j++) {
        int sj = 0;
        ok = fp8_bf16_pieces(x + j * k, k, xp, &sj);
        s[j] = sj;
        for (int64_t c = 0; ok && c < k; c++) { /* column c: chunk c / 64, lane l = c % 64 / 16, half c % 16 / 8 */
            const int64_t l = c % 64 / 16, h = c % 16 / 8, at = c / 64 * PIECE_WORDS + 32 * h + 8 * l + c % 8;
            for (int i = 0; i < 3; i++) pieces[(j * 3 + i) * k + c] = xp[at + 64 * i];
        }
    }
    free(xp);
    return ok;
}
