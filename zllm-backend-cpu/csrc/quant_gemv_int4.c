/* INT4 rows of the HF kernel layout (int4_g, quant_gemv.c) at the AVX2 level through vpmaddubsw
 * integer dot products, keeping f32-class activations: y[T, N] = x[T, K] @ W[N, K]^T (+ bias),
 * x and y f32, q uint8 [N, K / 2] (byte j: low nibble = column 2j, high = 2j + 1),
 * w[n, k] = scales[n, k / g] * (q[n, k] - zeros[n, k / g]).
 *
 * x as exact int8 digits (quant_digits.c, once per call, per token and per block of up to
 * DIGITS_BLOCK = 256 columns inside one scale group): x = d (a0 + a1 2^-7 + a2 2^-14 + a3 2^-21)
 * + r, d a power of two, |a0| <= 127, |a1 .. a3| <= 64, |r| ~ 2^-28 of the block's max |x|; per
 * 64 columns each digit's 32 even columns, then its 32 odd ones (DIGITS_NIBBLES), the order of
 * the nibbles of a 32-byte load of q: the low nibbles (one AND) are the even columns, the high
 * nibbles (a 16-bit shift and an AND) the odd ones, no unpacking.
 *
 * Per 64 columns: one load, an AND, a shift and an AND, then per token and digit two vpmaddubsw
 * (q 0 .. 15 the unsigned operand, the digits the signed one: int16 pair sums, at most 2 * 15 *
 * 127 = 3810) and two int16 additions into the digit's accumulator: 19 vector operations for one
 * token, where quant_gemv.c's dot_lanes decodes each nibble to f32 and takes an FMA (~33 with its
 * per-lane scale and zero point). A block of 256 columns adds 8 pair sums per int16 lane (at most
 * 30480 < 2^15); per block each digit's accumulator is widened by vpmaddwd against 2^7 (a0, a2)
 * or 1 (a1, a3), pairs added: int32 lane j holds hi = 2^7 c0 + c1 and lo = 2^7 c2 + c3 over
 * columns 8j .. 8j + 7 of each 64-column step (|hi|, |lo| < 2^23: exact in f32), then hi d 2^-7 +
 * lo d 2^-21 (exact product, one rounded FMA) minus z times the lane's x sum (quant_digits.c's lane
 * sums, one FNMADD: the zero point once a lane, the rounding relative to the lane's sum |q x| + z
 * |sum x|, as dot_lanes' per-lane sums) into the group's 8-lane f32 sum; per group that sum times
 * the scale into an 8-lane row total: s (sum q x - z sum x); then common.h's horizontal sum and +
 * bias. Against the f64 result the error is f32-class, at most dot_lanes' (tests: 1e-5 relative;
 * 1e-6 of sum s (q + z) |x| with outliers and x sums far from 0).
 *
 * Applies at the AVX2 level (native_isa_level below ISA_AVX512, or ZLLM_NATIVE_ISA=avx2) where K
 * is a multiple of 64 and the groups are multiples of 64 of at least 128 columns (or one per row
 * of at least 128); else quant_gemv.c's kernels take the call (AVX-512 keeps its lane kernels).
 * Groups of 64 are left out: there the per-group widening, conversion and scaling (~25 operations
 * a token) take most of what the steps save (1.18x dot_lanes' speed at T = 1, 0.81x at T = 2). A token
 * whose x holds a non-finite value, or a block whose max |x| is nonzero but under 2^-99, goes to
 * the f32 kernels alone (quant_gemv.c's gemv_digits): a token's kernel depends on its own x only.
 *
 * Measured (docs/performance.md, 2026-12-03, AVX2-only AMD EPYC (Zen 3), 2 shared cores): per call,
 * one thread, CPU time, against dot_lanes, N x K 3328 x 1280 / 1280 x 3328: groups of 128 1.45x /
 * 1.50x at T = 1 and 1.07x / 1.08x at T = 2, groups of 256 1.66x / 1.74x and 1.23x / 1.25x, per
 * channel 1.62x / 1.67x and 1.13x / 1.19x. bench/quant_gemv.py --repeats 15 --prefill 0 --layers 4
 * (groups of 128; three runs): int4_g / Q4_0 0.62-0.64x -> 0.79-0.81x at one thread (tok/s
 * 1.18-1.31x), 0.62-0.64x -> 0.76-0.81x at two (1.22-1.27x). The operation count, not the
 * vpmaddubsw throughput, bounds it on this machine (replacing every vpmaddubsw by a byte addition,
 * or the digit loads by constants, left the time unchanged; unrolling a group's steps and keeping
 * the accumulators in registers gained 1.2x): groups of 128 pay the per-group steps on every 128
 * columns, and two tokens share only the load and the nibble split, where dot_lanes shares its
 * whole decode.
 *
 * Order: a row's result depends only on its quants, scales and zero points, its token's x, K, g
 * and DIGITS_BLOCK, never on T, N, the other rows or the thread split. Tokens go two at a time
 * through one load of a row, each token's accumulators taking the same operations as alone.
 * Threads: work items of about DIGITS_CHUNK_BYTES of weights, handed out dynamically (quant_digits.c).
 */
#include "common.h"
#include "isa.h"
#include "quant_digits.h"


#define I4_TOKENS 2
#define I4_PREFETCH 2048

/* One block of STEPS 64-column steps: the row's bytes at qp against TT tokens' digits at dp
 * (tokens stride bytes apart; the block's digit weights at wp, its lane sums of x at lp) -> s[t],
 * the block's 8 lane sums of q x as f32, minus z (ZP: zv) times the lanes' x sums. STEPS, TT and
 * ZP constant: the steps unrolled, the accumulators in registers. */
INLINE void block_int4(const uint8_t *qp, const uint8_t *dp, const uint8_t *wp, const uint8_t *lp, int64_t stride,
                       __m256 zv, const int STEPS, const int TT, const int ZP, __m256 s[I4_TOKENS]) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i a[I4_TOKENS][DIGITS_N];
    for (int t = 0; t < TT; t++)
        for (int i = 0; i < DIGITS_N; i++) a[t][i] = _mm256_setzero_si256();
    for (int j = 0; j < STEPS; j++) {
        _mm_prefetch((const char *)qp + 32 * j + I4_PREFETCH, _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qp + 32 * j));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int t = 0; t < TT; t++)
            for (int i = 0; i < DIGITS_N; i++) {
                const uint8_t *d = dp + t * stride + 256 * j + 64 * i;
                const __m256i even = _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i *)d));
                const __m256i odd = _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i *)(d + 32)));
                a[t][i] = _mm256_add_epi16(a[t][i], _mm256_add_epi16(even, odd));
            }
        /* keeps the accumulators in registers: GCC 12 otherwise spills two of them and copies the
         * others each step with two tokens */
        if (TT == 1) __asm__("" : "+x"(a[0][0]), "+x"(a[0][1]), "+x"(a[0][2]), "+x"(a[0][3]));
        else __asm__("" : "+x"(a[0][0]), "+x"(a[0][1]), "+x"(a[0][2]), "+x"(a[0][3]), "+x"(a[1][0]), "+x"(a[1][1]),
                          "+x"(a[1][2]), "+x"(a[1][3]));
    }
    const __m256i w7 = _mm256_set1_epi16(128), w0 = _mm256_set1_epi16(1);
    for (int t = 0; t < TT; t++) {
        const float *wb = (const float *)(wp + t * stride);
        const __m256i h = _mm256_add_epi32(_mm256_madd_epi16(a[t][0], w7), _mm256_madd_epi16(a[t][1], w0));
        const __m256i l = _mm256_add_epi32(_mm256_madd_epi16(a[t][2], w7), _mm256_madd_epi16(a[t][3], w0));
        s[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(wb[0]),
                               _mm256_mul_ps(_mm256_cvtepi32_ps(l), _mm256_set1_ps(wb[1])));
        if (ZP) s[t] = _mm256_fnmadd_ps(zv, _mm256_loadu_ps((const float *)(lp + t * stride)), s[t]);
    }
}

/* Row r (its bytes row, scales sf, zero points zr where ZP) times TT tokens' digits -> y[t]
 * (file comment), for groups of STEPS 64-column steps (g = 64 STEPS <= DIGITS_BLOCK, K a
 * multiple of g): one block a group, its sum times the scale into the row total. */
INLINE void dot_groups(const digits_layout *L, const uint8_t *row, const float *sf, const uint8_t *zr,
                       const uint8_t *dg, float *y, const int STEPS, const int TT, const int ZP) {
    const int64_t stride = L->stride;
    const uint8_t *qp = row, *dp = dg, *wp = dg + L->w_at, *lp = dg + L->sums_at;
    __m256 tot[I4_TOKENS];
    for (int t = 0; t < TT; t++) tot[t] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < L->ng; gi++, qp += 32 * STEPS, dp += 256 * STEPS, wp += 8, lp += 32) {
        const __m256 zv = ZP ? _mm256_set1_ps((float)zr[gi]) : _mm256_setzero_ps();
        __m256 s[I4_TOKENS];
        block_int4(qp, dp, wp, lp, stride, zv, STEPS, TT, ZP, s);
        const __m256 sc = _mm256_set1_ps(sf[gi]);
        for (int t = 0; t < TT; t++) tot[t] = _mm256_fmadd_ps(s[t], sc, tot[t]);
    }
    for (int t = 0; t < TT; t++) y[t] = hsum(tot[t]);
}

/* Row r times TT tokens' digits -> y[t] (file comment), any group of a multiple of 64 columns
 * (or one per row): per group its blocks of up to DIGITS_BLOCK columns, their sums added in
 * order, times the scale into the row total. The same operations as dot_groups where both apply. */
INLINE void dot_blocks(const digits_layout *L, const uint8_t *row, const float *sf, const uint8_t *zr,
                       const uint8_t *dg, float *y, const int TT, const int ZP) {
    const int64_t stride = L->stride;
    const uint8_t *qp = row, *dp = dg, *wp = dg + L->w_at, *lp = dg + L->sums_at;
    __m256 tot[I4_TOKENS];
    for (int t = 0; t < TT; t++) tot[t] = _mm256_setzero_ps();
    for (int64_t gi = 0, left = L->k; gi < L->ng; gi++) {
        int64_t steps = (left < L->g ? left : L->g) / 64; /* the group's */
        left -= 64 * steps;
        const __m256 zv = ZP ? _mm256_set1_ps((float)zr[gi]) : _mm256_setzero_ps();
        __m256 gs[I4_TOKENS] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* set by the first block */
        for (int first = 1; steps > 0; first = 0) {
            const int64_t bs = steps < DIGITS_BLOCK / 64 ? steps : DIGITS_BLOCK / 64;
            __m256 s[I4_TOKENS];
            if (bs == 4) block_int4(qp, dp, wp, lp, stride, zv, 4, TT, ZP, s);
            else if (bs == 3) block_int4(qp, dp, wp, lp, stride, zv, 3, TT, ZP, s);
            else if (bs == 2) block_int4(qp, dp, wp, lp, stride, zv, 2, TT, ZP, s);
            else block_int4(qp, dp, wp, lp, stride, zv, 1, TT, ZP, s);
            for (int t = 0; t < TT; t++) gs[t] = first ? s[t] : _mm256_add_ps(gs[t], s[t]);
            qp += 32 * bs, dp += 256 * bs, wp += 8, lp += 32, steps -= bs;
        }
        const __m256 sc = _mm256_set1_ps(sf[gi]);
        for (int t = 0; t < TT; t++) tot[t] = _mm256_fmadd_ps(gs[t], sc, tot[t]);
    }
    for (int t = 0; t < TT; t++) y[t] = hsum(tot[t]);
}

/* Row r times TT tokens' digits at d -> v[t]: dot_groups for groups of 128 or 256 columns
 * dividing K (the steps unrolled, no loop per block: at g = 128 1.2x the speed of a loop over the
 * 64-column steps), else dot_blocks; with or without zero points. */
#define DOT_ROW(TT)                                                                                                 \
    do {                                                                                                            \
        const int64_t steps = L->k % L->g == 0 ? L->g / 64 : 0;                                                     \
        if (steps == 2) zr ? dot_groups(L, row, sf, zr, d, v, 2, TT, 1) : dot_groups(L, row, sf, zr, d, v, 2, TT, 0); \
        else if (steps == 4) zr ? dot_groups(L, row, sf, zr, d, v, 4, TT, 1) : dot_groups(L, row, sf, zr, d, v, 4, TT, 0); \
        else zr ? dot_blocks(L, row, sf, zr, d, v, TT, 1) : dot_blocks(L, row, sf, zr, d, v, TT, 0);                \
    } while (0)

/* Rows [r0, r1) times all T tokens' digits -> y [T, N]. */
static void rows_int4(const digits_layout *L, const uint8_t *q, const float *scales, const uint8_t *zeros,
                      const uint8_t *dg, const float *bias, float *y, int64_t n, int64_t t, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = q + r * (L->k / 2), *zr = zeros ? zeros + r * L->ng : 0;
        const float *sf = scales + r * L->ng;
        float v[I4_TOKENS];
        int64_t j = 0;
        for (; j + I4_TOKENS <= t; j += I4_TOKENS) {
            const uint8_t *d = dg + j * L->stride;
            DOT_ROW(I4_TOKENS);
            for (int i = 0; i < I4_TOKENS; i++) y[(j + i) * n + r] = bias ? v[i] + bias[r] : v[i];
        }
        if (j < t) {
            const uint8_t *d = dg + j * L->stride;
            DOT_ROW(1);
            y[j * n + r] = bias ? v[0] + bias[r] : v[0];
        }
    }
}

/* quant_digits.h: the leading tokens whose x digits_split_token holds, through rows_int4. */
int64_t int4_digits_gemv(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g, const float *x,
                         int64_t xs, const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads) {
    if (native_isa_level >= ISA_AVX512 || k <= 0 || k % 64 || g <= 0 || (g % 64 && g < k) || (g < k ? g : k) < 128 ||
        t <= 0 || n <= 0)
        return -1;
    return digits_gemv(rows_int4, DIGITS_NIBBLES, k / 2, q, scales, zeros, g, x, xs, bias, y, t, n, k, threads);
}
