/* Shared by the paged decode attention kernels (attention.c: GQA over K/V caches; mla.c: MLA
 * over a latent cache): walking a sequence's keys through its block table, prefetching,
 * per-thread scratch, and one work item of decode attention — G query heads of one row over
 * the row's keys in three passes (scores, softmax, weighted sum of values), reduced in the
 * fixed order attention.c's header describes. A key row holds DK values, a value row DV values
 * at the same element offset in its own cache (GQA: K and V caches, DK = DV = D; MLA: the
 * latent cache for both, DK = R + Dr, DV = R, the value being the row's first R values).
 * Static functions: each including file gets its own copy (and its own scratch).
 */
#ifndef ZLLM_NATIVE_PAGED_H
#define ZLLM_NATIVE_PAGED_H

#include <stdlib.h>
#include <string.h>

#include "common.h"

#define KEYS_CHUNK 64                 /* keys per chunk that all query heads of a group use (multiple of 8) */
#define L1_KEY_BYTES (32 << 10)     /* bytes of key rows a pass-1 chunk may take (L1 is 32-48 KiB) */
#define PREFETCH_KEYS 16              /* keys ahead whose K / V rows are prefetched (8-32 measured alike) */

/* ---- vector helpers ---- */

/* The horizontal sums of eight vectors as one: lane i = sum of a[i]'s lanes, each summed as
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
INLINE __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [a0..a3 lo | a0..a3 hi], a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* ---- walking a sequence's keys through its block table ---- */

/* Element offsets (from the cache's start) of the rows of keys k0 .. k0 + nk - 1 of KV head
 * hk (head: hk * D; tok: Hkv * D), padded with the last one to round8(nk); reads only the
 * table entries of the blocks holding these keys. */
static void key_offsets(const int64_t *table, int64_t k0, int64_t nk, int64_t bs, int64_t tok, int64_t head,
                        int64_t *offs) {
    int64_t blk = k0 / bs, off = k0 % bs, base = (table[blk] * bs + off) * tok + head;
    for (int64_t i = 0; i < nk; i++) {
        if (off == bs) {
            off = 0;
            base = table[++blk] * bs * tok + head;
        }
        offs[i] = base;
        off++;
        base += tok;
    }
    for (int64_t i = nk; i < ((nk + 7) & ~(int64_t)7); i++) offs[i] = offs[nk - 1];
}

/* Prefetch the cache lines of one row of `bytes` bytes at p. */
INLINE void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
    _mm_prefetch((const char *)p + bytes - 1, _MM_HINT_T0);
}

/* This thread's scratch of at least `bytes` bytes, kept from call to call (the OpenMP pool's
 * threads live as long as the process); NULL when it cannot be had. */
static void *scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = bytes > 2 * cap ? bytes : 2 * cap;
        buf = malloc(cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* ---- one work item (G query heads of one decode row), per cache type ---- */

#define ITEM(NAME, CT)                                                                          \
/* Scores of 8 keys (offsets offs[0..7]) for one query head q: [8] lanes, scaled. */           \
INLINE __m256 scores8_##NAME(const CT *kc, const int64_t *offs, const float *q, int64_t d, float scale) { \
    __m256 a[8];                                                                                \
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();                                    \
    int64_t e = 0;                                                                              \
    for (; e + 8 <= d; e += 8) {                                                                \
        const __m256 qv = _mm256_loadu_ps(q + e);                                              \
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(load8_##NAME(kc + offs[i] + e), qv, a[i]); \
    }                                                                                           \
    __m256 s = hsum8x8(a);                                                                      \
    if (e < d) {                                                                                \
        float t[8];                                                                             \
        _mm256_storeu_ps(t, s);                                                                 \
        for (int i = 0; i < 8; i++)                                                             \
            for (int64_t f = e; f < d; f++) t[i] = fmaf(load1_##NAME(kc + offs[i] + f), q[f], t[i]); \
        s = _mm256_loadu_ps(t);                                                                 \
    }                                                                                           \
    return _mm256_mul_ps(s, _mm256_set1_ps(scale));                                             \
}                                                                                               \
                                                                                                \
/* o[0 .. 8 NV) (+)= sum over nk keys of w[j] * v_j[e0 ..]; NV is a constant at each call, so  \
 * the accumulators stay in registers. pf: NULL, or keys whose whole rows to prefetch, one per \
 * key for the first npf keys. */                                                               \
INLINE void accum_n_##NAME(const CT *vc, const int64_t *offs, int64_t nk, const float *w, float *o, \
                           int64_t e0, int first, const int64_t *pf, int64_t npf, int64_t row_bytes, \
                           const int NV) {                                                      \
    __m256 a[8];                                                                                \
    for (int i = 0; i < NV; i++) a[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * i); \
    for (int64_t j = 0; j < nk; j++) {                                                          \
        if (pf && j < npf) prefetch_row(vc + pf[j], row_bytes);                                 \
        const __m256 wj = _mm256_broadcast_ss(w + j);                                           \
        const CT *vp = vc + offs[j] + e0;                                                       \
        for (int i = 0; i < NV; i++) a[i] = _mm256_fmadd_ps(wj, load8_##NAME(vp + 8 * i), a[i]); \
    }                                                                                           \
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + 8 * i, a[i]);                             \
}                                                                                               \
                                                                                                \
static void accum_##NAME(const CT *vc, const int64_t *offs, int64_t nk, const float *w, float *o, \
                         int64_t e0, int first, const int64_t *pf, int64_t npf, int64_t row_bytes, int nv) { \
    switch (nv) {                                                                               \
    case 1: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 1); break;        \
    case 2: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 2); break;        \
    case 3: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 3); break;        \
    case 4: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 4); break;        \
    case 5: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 5); break;        \
    case 6: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 6); break;        \
    case 7: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 7); break;        \
    default: accum_n_##NAME(vc, offs, nk, w, o, e0, first, pf, npf, row_bytes, 8); break;       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* Query heads q[0 .. G) (head stride q_hs, DK values each) of one row over nk keys -> o [G, DV]. \
 * offs: the keys' element offsets in the caches, padded to round8(nk) with the last one; sc:  \
 * scratch of G * round8(nk) floats; sinks: the G heads' sink logits (gpt-oss: one more column \
 * of each softmax, with no value), or NULL. */                                                 \
static void item_##NAME(const float *q, int64_t q_hs, const CT *kc, const CT *vc, const int64_t *offs, \
                        int64_t dk, int64_t dv, int64_t nk, int64_t g, float scale, const float *sinks, \
                        float *o, float *sc) { \
    const int64_t lp = (nk + 7) & ~(int64_t)7;                                                  \
    const int64_t k_bytes = dk * (int64_t)sizeof(CT), v_bytes = dv * (int64_t)sizeof(CT);       \
    /* pass 1's chunk: KEYS_CHUNK keys, fewer for wide key rows (MLA: W = 576) so that the     \
     * chunk stays in L1 while every head of the group reads it */                            \
    const int64_t fit = (L1_KEY_BYTES / k_bytes) & ~(int64_t)7;                                 \
    const int64_t chunk = fit < 8 ? 8 : fit < KEYS_CHUNK ? fit : KEYS_CHUNK;                    \
    /* pass 1: scores, a chunk of keys for every query head; the first head's sweep prefetches \
     * the keys PREFETCH_KEYS ahead */                                                          \
    for (int64_t j0 = 0; j0 < lp; j0 += chunk) {                                                \
        const int64_t n8 = lp - j0 < chunk ? lp - j0 : chunk;                                   \
        for (int64_t gi = 0; gi < g; gi++)                                                      \
            for (int64_t t = j0; t < j0 + n8; t += 8) {                                         \
                if (gi == 0)                                                                    \
                    for (int64_t i = t + PREFETCH_KEYS; i < t + PREFETCH_KEYS + 8 && i < nk; i++) \
                        prefetch_row(kc + offs[i], k_bytes);                                    \
                _mm256_storeu_ps(sc + gi * lp + t, scores8_##NAME(kc, offs + t, q + gi * q_hs, dk, scale)); \
            }                                                                                   \
    }                                                                                           \
    /* pass 2: softmax; the padding lanes get -inf, so e = 0 there */                           \
    for (int64_t gi = 0; gi < g; gi++) {                                                        \
        float *s = sc + gi * lp;                                                                \
        for (int64_t j = nk; j < lp; j++) s[j] = -INFINITY;                                    \
        __m256 m = _mm256_set1_ps(-INFINITY);                                                   \
        for (int64_t j = 0; j < lp; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));       \
        const float mx = hmax(m), mk = sinks && sinks[gi] > mx ? sinks[gi] : mx;                \
        const __m256 mv = _mm256_set1_ps(mk);                                                   \
        __m256 sum = _mm256_setzero_ps();                                                       \
        for (int64_t j = 0; j < lp; j += 8) {                                                   \
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));                   \
            _mm256_storeu_ps(s + j, e);                                                         \
            sum = _mm256_add_ps(sum, e);                                                        \
        }                                                                                       \
        /* the sink's e = exp(sink - max) joins the denominator last */                        \
        const float sink_e = sinks ? _mm256_cvtss_f32(exp8(_mm256_set1_ps(sinks[gi] - mk))) : 0.0f; \
        const __m256 tv = _mm256_set1_ps(hsum(sum) + sink_e);                                   \
        for (int64_t j = 0; j < lp; j += 8) _mm256_storeu_ps(s + j, _mm256_div_ps(_mm256_loadu_ps(s + j), tv)); \
    }                                                                                           \
    /* pass 3: weighted sum of the values, a chunk of keys at a time, dims in tiles of up to  \
     * 64, the D % 8 tail scalar; the first sweep over a chunk prefetches */                   \
    const int64_t nvec = dv / 8;                                                                \
    for (int64_t j0 = 0; j0 < nk; j0 += KEYS_CHUNK) {                                           \
        const int64_t n = nk - j0 < KEYS_CHUNK ? nk - j0 : KEYS_CHUNK;                          \
        const int64_t npf = nk - j0 - PREFETCH_KEYS < n ? nk - j0 - PREFETCH_KEYS : n;          \
        for (int64_t c = 0; c < nvec; c += 8)                                                   \
            for (int64_t gi = 0; gi < g; gi++)                                                  \
                accum_##NAME(vc, offs + j0, n, sc + gi * lp + j0, o + gi * dv + 8 * c, 8 * c, j0 == 0, \
                             c == 0 && gi == 0 ? offs + j0 + PREFETCH_KEYS : NULL, npf, v_bytes,   \
                             (int)(nvec - c < 8 ? nvec - c : 8));                               \
        for (int64_t gi = 0; gi < g; gi++) {                                                    \
            const float *w = sc + gi * lp + j0;                                                 \
            if (nvec == 0 && gi == 0)                                                           \
                for (int64_t j = 0; j < npf; j++) prefetch_row(vc + offs[j0 + j + PREFETCH_KEYS], v_bytes); \
            for (int64_t e = 8 * nvec; e < dv; e++) {                                           \
                float a = j0 == 0 ? 0.0f : o[gi * dv + e];                                      \
                for (int64_t j = 0; j < n; j++) a = fmaf(w[j], load1_##NAME(vc + offs[j0 + j] + e), a); \
                o[gi * dv + e] = a;                                                             \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

ITEM(f32, float)
ITEM(f16, uint16_t)
ITEM(bf16, uint16_t)

/* One row of d f32 values -> the cache type (the D % 8 tail through an 8-lane store too, so
 * every value is converted the same way). */
#define CONVERT_ROW(NAME, CT)                                                                   \
INLINE void convert_row_##NAME(CT *dst, const float *src, int64_t d) {                          \
    int64_t e = 0;                                                                              \
    for (; e + 8 <= d; e += 8) store8_##NAME(dst + e, load8_f32(src + e));                      \
    if (e < d) {                                                                                \
        float t[8] = {0};                                                                       \
        CT c[8];                                                                                \
        memcpy(t, src + e, (size_t)(d - e) * sizeof(float));                                   \
        store8_##NAME(c, _mm256_loadu_ps(t));                                                   \
        memcpy(dst + e, c, (size_t)(d - e) * sizeof(CT));                                      \
    }                                                                                           \
}

CONVERT_ROW(f32, float)
CONVERT_ROW(f16, uint16_t)
CONVERT_ROW(bf16, uint16_t)

#endif
