/* Shared by the native kernels of zllm-backend-cpu (gemv.c, elementwise.c, attention.c):
 * inlining, horizontal sums, loads of 8 (or 1) stored values as f32 lanes, stores of 8 lanes
 * to 16-bit types, and e^x for 8 lanes.
 *
 * Every file is built with -mavx2 -mfma -mf16c (not -march=native), so
 * zllm_native_cpu_missing() (library.c) can check at load time exactly what the code needs;
 * the AVX-512 row kernels are compiled per function (isa.h) and called only where the CPU
 * has them.
 */
#ifndef ZLLM_NATIVE_COMMON_H
#define ZLLM_NATIVE_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define MAX_THREADS 256 /* more threads than this are capped */

/* A GEMV whose weight bytes times tokens fall below this runs on the calling thread alone. In a
 * decode step the team's other threads have gone idle during the Python between two calls, and
 * waking and joining them cost more than they saved on the small weights (attention
 * projections, routers): at 512 KB, Qwen3-MoE Q8_0 decode went from 20.7 to 16.8 ms a step and
 * DeepSeek-V2-Lite's from 33 to 30 ms (2 threads, medians of 4-5 interleaved runs; 1 MB
 * measured the same). A microbenchmark calling one GEMV in a loop does not see it: there the
 * threads are still spinning. */
#define GEMV_PARALLEL_MIN_WORK (512 << 10)

/* The team of a GEMV cut into `items` work items, `work` its weight bytes times tokens: the
 * caller's threads, at most one a work item and MAX_THREADS; one under GEMV_PARALLEL_MIN_WORK. */
INLINE int gemv_team(int threads, int64_t items, int64_t work) {
    const int nth = work < GEMV_PARALLEL_MIN_WORK ? 1 : threads < items ? threads : (int)items;
    return nth < MAX_THREADS ? (nth > 1 ? nth : 1) : MAX_THREADS;
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- 8 consecutive stored values as f32 lanes, and one value as f32 ---- */

INLINE __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
INLINE float load1_f32(const float *p) { return *p; }

INLINE __m256 load8_bf16(const uint16_t *p) {
    /* bf16 is the top half of an f32: widen and shift (exact) */
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
INLINE float load1_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } v = {(uint32_t)*p << 16};
    return v.f;
}

INLINE __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE float load1_f16(const uint16_t *p) { return _cvtsh_ss(*p); }

/* 8 f32 lanes stored as bf16 (round to nearest even, as torch's .to(torch.bfloat16); NaN
 * stays NaN) and as f16 (F16C, round to nearest even). */
INLINE void store8_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
INLINE void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), _mm256_castps_si256(nan));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
INLINE void store8_f16(uint16_t *p, __m256 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

/* e^x for 8 lanes, max error 1 ulp over the whole f32 range (subnormal results included);
 * NaN stays NaN, e^-inf = 0. Sleef's xexpf (expf_u10): x = n ln2 + r, |r| <= ln2 / 2, with
 * ln2 split in two (Cody-Waite), e^r by a degree-6 polynomial, then * 2^n in two steps so
 * that each factor stays a normal number. */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x); /* operand order keeps NaN: e^-104 < 2^-150 rounds to 0 */
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);   /* e^89 > FLT_MAX: still inf */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.442695040888963407359924681001892137f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, r, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, r, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, r, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, r, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, r, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(r, r), u, r));
    /* * 2^n as 2^(n >> 1) * 2^(n - (n >> 1)): n in [-150, 129], each half a normal power of two */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
}

#endif
