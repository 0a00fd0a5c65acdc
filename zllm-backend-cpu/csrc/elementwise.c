/* Native element-wise kernels of a decoder layer, for f32 activations: RMSNorm, fused residual
 * add + RMSNorm, rotary position embeddings (GPT-NeoX and GPT-J layouts) and SiLU-and-mul.
 *
 * Why native: at decode each call touches a few thousand floats, so the torch versions
 * (3-6 aten ops each, every one allocating and dispatching) spend ~50 us per call on
 * overhead against ~1 us of arithmetic; a decode step makes ~5 such calls per layer.
 *
 * Layouts: rows of f32 with a row stride in elements (inputs may be views, e.g. q and k of a
 * fused QKV projection); the innermost dimension is contiguous; outputs are contiguous.
 * Norm weights are f32, f16 or bf16 (converted exactly to f32).
 *
 * Numerics (f32 throughout, -ffp-contract=off; each row computed alone in a fixed order, so
 * every kernel is batch-invariant):
 *   rms_norm: sum of squares in four 8-lane accumulators over chunks of 32 (as gemv.c's dense
 *     dot), the tail one term at a time, inv = 1 / sqrtf(sum / K + eps), y = (x * inv) * w —
 *     the reference's formula (HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)));
 *   rope: out[i] = x[i] c - x[j] s and out[j] = x[j] c + x[i] s, each product rounded, then
 *     the sum (j = i + D/2 for neox, pairs (2i, 2i + 1) for gptj) — exactly the torch kernel's
 *     arithmetic;
 *   silu_mul: g / (1 + exp(-g)) * u with the vectorized exp of common.h (max error 1 ulp),
 *     so within a few ulp of torch's silu.
 *
 * Threads: rows are split across OpenMP threads (torch's pool) only when a call has at least
 * PARALLEL_MIN elements: below that, waking a second thread costs more than the work.
 */
#include "common.h"

#define PARALLEL_MIN (1 << 15)

/* Threads for T rows of K elements: at most `threads`, at most T, and 1 for small calls. */
INLINE int team(int threads, int64_t t, int64_t k) {
    if (t * k < PARALLEL_MIN || threads <= 1) return 1;
    return (int)(t < threads ? t : threads);
}

/* ---- RMSNorm ---- */

INLINE float sum_squares(const float *x, int64_t k) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t j = 0;
    for (; j + 32 <= k; j += 32)
        for (int i = 0; i < 4; i++) {
            const __m256 v = _mm256_loadu_ps(x + j + 8 * i);
            a[i] = _mm256_fmadd_ps(v, v, a[i]);
        }
    for (int i = 0; i < 3; i++) {
        if (j + 8 > k) break;
        const __m256 v = _mm256_loadu_ps(x + j);
        a[i] = _mm256_fmadd_ps(v, v, a[i]);
        j += 8;
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
    for (; j < k; j++) s = fmaf(x[j], x[j], s);
    return s;
}

/* y = (x * inv) * w for one row */
#define SCALE_ROW(NAME, WT)                                                                     \
INLINE void scale_row_##NAME(const float *x, const WT *w, float *y, int64_t k, float inv) {     \
    const __m256 vi = _mm256_set1_ps(inv);                                                      \
    int64_t j = 0;                                                                              \
    for (; j + 8 <= k; j += 8)                                                                  \
        _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vi), load8_##NAME(w + j))); \
    for (; j < k; j++) y[j] = (x[j] * inv) * load1_##NAME(w + j);                              \
}

SCALE_ROW(f32, float)
SCALE_ROW(bf16, uint16_t)
SCALE_ROW(f16, uint16_t)

/* zllm_rms_norm_<w>: x [T, K] (row stride xs) -> y [T, K]; w [K]. */
#define RMS_NORM(NAME, WT)                                                                      \
void zllm_rms_norm_##NAME(const float *x, int64_t xs, const WT *w, float *y, int64_t t, int64_t k, \
                          float eps, int threads) {                                             \
    const int nth = team(threads, t, k);                                                        \
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")                                   \
    for (int64_t r = 0; r < t; r++) {                                                           \
        const float *xr = x + r * xs;                                                           \
        const float inv = 1.0f / sqrtf(sum_squares(xr, k) / (float)k + eps);                    \
        scale_row_##NAME(xr, w, y + r * k, k, inv);                                             \
    }                                                                                           \
}

/* zllm_add_rms_norm_<w>: h = x + r (x, r [T, K], row strides xs, rs) -> h [T, K], and
 * y = rms_norm(h) [T, K]. */
#define ADD_RMS_NORM(NAME, WT)                                                                  \
void zllm_add_rms_norm_##NAME(const float *x, int64_t xs, const float *res, int64_t rs, const WT *w, \
                              float *y, float *h, int64_t t, int64_t k, float eps, int threads) { \
    const int nth = team(threads, t, k);                                                        \
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")                                   \
    for (int64_t r = 0; r < t; r++) {                                                           \
        const float *xr = x + r * xs, *rr = res + r * rs;                                       \
        float *hr = h + r * k;                                                                  \
        int64_t j = 0;                                                                          \
        for (; j + 8 <= k; j += 8)                                                              \
            _mm256_storeu_ps(hr + j, _mm256_add_ps(_mm256_loadu_ps(xr + j), _mm256_loadu_ps(rr + j))); \
        for (; j < k; j++) hr[j] = xr[j] + rr[j];                                               \
        const float inv = 1.0f / sqrtf(sum_squares(hr, k) / (float)k + eps);                    \
        scale_row_##NAME(hr, w, y + r * k, k, inv);                                             \
    }                                                                                           \
}

RMS_NORM(f32, float)
RMS_NORM(bf16, uint16_t)
RMS_NORM(f16, uint16_t)
ADD_RMS_NORM(f32, float)
ADD_RMS_NORM(bf16, uint16_t)
ADD_RMS_NORM(f16, uint16_t)

/* ---- RoPE ---- */

/* One head: neox rotates pairs (i, i + D/2), gptj pairs (2i, 2i + 1); half = D / 2. */
INLINE void rope_head_neox(const float *x, const float *c, const float *s, float *y, int64_t half) {
    const float *xj = x + half;
    float *yj = y + half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(xj + i);
        const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(y + i, _mm256_sub_ps(_mm256_mul_ps(a, vc), _mm256_mul_ps(b, vs)));
        _mm256_storeu_ps(yj + i, _mm256_add_ps(_mm256_mul_ps(b, vc), _mm256_mul_ps(a, vs)));
    }
    for (; i < half; i++) {
        const float a = x[i], b = xj[i];
        y[i] = a * c[i] - b * s[i];
        yj[i] = b * c[i] + a * s[i];
    }
}

INLINE void rope_head_gptj(const float *x, const float *c, const float *s, float *y, int64_t half) {
    int64_t i = 0;
    for (; i + 4 <= half; i += 4) { /* 4 pairs: lanes (a0 b0 a1 b1 ...), cos / sin duplicated per pair */
        const __m128 c4 = _mm_loadu_ps(c + i), s4 = _mm_loadu_ps(s + i);
        const __m256 vc = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
        const __m256 vs = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
        const __m256 v = _mm256_loadu_ps(x + 2 * i);
        const __m256 swapped = _mm256_permute_ps(v, 0xB1); /* (b0 a0 b1 a1 ...) */
        /* even lanes a c - b s, odd lanes b c + a s: the scalar roundings */
        _mm256_storeu_ps(y + 2 * i, _mm256_addsub_ps(_mm256_mul_ps(v, vc), _mm256_mul_ps(swapped, vs)));
    }
    for (; i < half; i++) {
        const float a = x[2 * i], b = x[2 * i + 1];
        y[2 * i] = a * c[i] - b * s[i];
        y[2 * i + 1] = b * c[i] + a * s[i];
    }
}

/* zllm_rope_<layout>: x [T, H, D] (token stride ts, head stride hs), cos/sin [T, D/2] (row
 * strides cs, ss) -> y [T, H, D] contiguous. */
#define ROPE(LAYOUT)                                                                            \
void zllm_rope_##LAYOUT(const float *x, int64_t ts, int64_t hs, const float *cos, int64_t cs,   \
                        const float *sin, int64_t ss, float *y, int64_t t, int64_t nh, int64_t d, \
                        int threads) {                                                          \
    const int nth = team(threads, t, nh * d);                                                   \
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")                                   \
    for (int64_t r = 0; r < t; r++)                                                             \
        for (int64_t h = 0; h < nh; h++)                                                        \
            rope_head_##LAYOUT(x + r * ts + h * hs, cos + r * cs, sin + r * ss, y + (r * nh + h) * d, d / 2); \
}

ROPE(neox)
ROPE(gptj)

/* ---- SiLU-and-mul ---- */

/* zllm_silu_mul: gate, up [T, N] (row strides gs, us) -> y = silu(gate) * up [T, N]. */
void zllm_silu_mul(const float *gate, int64_t gs, const float *up, int64_t us, float *y, int64_t t, int64_t n,
                   int threads) {
    const int nth = team(threads, t, n);
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")
    for (int64_t r = 0; r < t; r++) {
        const float *g = gate + r * gs, *u = up + r * us;
        float *yr = y + r * n;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 vg = _mm256_loadu_ps(g + j);
            const __m256 e = exp8(_mm256_xor_ps(vg, sign));
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
        for (; j < n; j++) yr[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
