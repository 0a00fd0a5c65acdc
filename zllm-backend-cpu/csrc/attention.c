/* Native paged attention for decode steps: the KV write and one query token per sequence
 * attending to its cached context, reading the K/V blocks in place from the paged cache.
 *
 * Layout (vLLM's PagedAttention): caches [NB, BS, Hkv, D] contiguous, f32 / f16 / bf16; the
 * context token at position p of a sequence lives in block block_table[p / BS] at offset
 * p % BS, so the D values of one (token, KV head) are contiguous and consecutive tokens of
 * a block are Hkv * D elements apart. Queries and new keys/values are f32 with a token
 * stride and a head stride of their own (views into a fused QKV projection work as they
 * are); D is contiguous everywhere. A decode row's query is the last of its L context
 * tokens, so it sees keys 0 .. L - 1, or with a sliding window W only L - W .. L - 1: no
 * block-table entry before the window's first block is read (a sliding-window cache frees
 * those blocks and marks them -1).
 *
 * Work: one item per (decode row, KV head). An item takes the G = H / Hkv query heads that
 * share its KV head together, so each K and V row is read once per group:
 *   pass 1: scores s[g, j] = (q_g . k_j) * scale into a per-thread scratch [G, L'] (L' keys
 *           the row sees, rounded up to 8; heap, since L may be the whole context);
 *   pass 2: per query head, the max m, e_j = exp(s_j - m), their sum, w_j = e_j / sum
 *           (the f32 reference's softmax, step by step);
 *   pass 3: o[g, :] = sum_j w[g, j] * v_j, accumulated in f32 in the output row.
 * The item first lists the element offsets of its keys' rows by walking the block table once
 * (into the scratch); every pass then goes through that list. Pass 1 and 3 take the keys in
 * chunks of KEYS_CHUNK that every query head of the group uses while they are in L1, and
 * prefetch the K / V rows PREFETCH_KEYS keys ahead: a key's row for one KV head is D values
 * in a token row of Hkv * D, so consecutive keys are far apart and the hardware prefetchers
 * miss them (measured 1.3-2.2x faster with it once the cache is larger than L2).
 * Two passes over stored scores rather than an online (running max, rescaled) softmax: no
 * rescaling of the accumulators, exps 8 lanes at a time, and the softmax exactly as the
 * reference writes it; the scratch is 4 * (G + 2) * L' bytes (32k context, G = 8: 1.3 MiB
 * per thread).
 *
 * Numerics: f32 throughout; every value is reduced in one fixed order that depends only on D
 * and on the row's own L and W (never on the thread split, the item's position, or the other
 * rows), so a decode row's output is bit-identical whatever else is in the call
 * (batch-invariant) and for any thread count:
 *   score: one 8-lane FMA accumulator over the whole chunks of 8 dims (from zero), summed
 *          as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (hsum8x8: eight keys at a
 *          time), then the D % 8 tail one fused multiply-add at a time, then * scale;
 *   softmax: max (exact in any order); exp by exp8 (Sleef's expf_u10 scheme: Cody-Waite
 *          reduction, degree-6 polynomial, two-step scaling so that subnormal results are
 *          rounded once; max error 0.99 ulp, checked against double exp for
 *          every f32 input in [-104, 89]); the sum in 8 lanes (lane = key index
 *          % 8 from the window's first key) then hsum (common.h); w_j = e_j / sum;
 *   output: per output element one FMA chain over the keys in order, from zero.
 * Agreement with the f32 reference (zllm.domain.attention) is ~1e-6: only the exp's last bit
 * and the summation orders differ.
 *
 * KV write: each (token, KV head) row of D values converted to the cache's type —
 * bit-identical to torch's .to(dtype) for finite values (store8_* in common.h; round to
 * nearest even) — at slot = block * BS + offset; a negative slot is padding and is skipped,
 * as is one at or past the end of the cache (NB * BS slots).
 *
 * Checks: a decode row whose L is < 1, or whose window reaches a block-table entry outside
 * [0, NB) or past the table's MB columns, gets NaN for its output instead of a read outside
 * the cache (and so does one whose scratch cannot be allocated).
 *
 * Threads: OpenMP with the caller's thread count (torch's; the library shares torch's
 * libgomp, see gemv.c), at most one per item, and one for a call of fewer than
 * ATTENTION_PARALLEL_MIN score multiply-adds; items are handed out one at a time in
 * (row, KV head) order, so rows of unequal length balance. Each thread keeps its scratch
 * from call to call, grown to the largest a call needed.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define KEYS_CHUNK 64                 /* keys per chunk that all query heads of a group use (multiple of 8) */
#define PREFETCH_KEYS 16              /* keys ahead whose K / V rows are prefetched (8-32 measured alike) */
#define WRITE_PARALLEL_MIN (1 << 16)  /* values a KV write needs before it uses threads */
#define ATTENTION_PARALLEL_MIN (1 << 16)  /* score multiply-adds (keys x H x D) a call needs before it
                                          * uses threads: below, waking a thread costs more than the work */

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

/* ---- one (row, KV head) item, per cache type ---- */

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
/* Query heads q[0 .. G) (head stride q_hs) of one row over nk keys -> o [G, D]. offs: the     \
 * keys' element offsets in the caches, padded to round8(nk) with the last one; sc: scratch of \
 * G * round8(nk) floats. */                                                                    \
static void item_##NAME(const float *q, int64_t q_hs, const CT *kc, const CT *vc, const int64_t *offs, \
                        int64_t d, int64_t nk, int64_t g, float scale, float *o, float *sc) {   \
    const int64_t lp = (nk + 7) & ~(int64_t)7, row_bytes = d * (int64_t)sizeof(CT);            \
    /* pass 1: scores, a chunk of keys for every query head; the first head's sweep prefetches \
     * the keys PREFETCH_KEYS ahead */                                                          \
    for (int64_t j0 = 0; j0 < lp; j0 += KEYS_CHUNK) {                                           \
        const int64_t n8 = lp - j0 < KEYS_CHUNK ? lp - j0 : KEYS_CHUNK;                         \
        for (int64_t gi = 0; gi < g; gi++)                                                      \
            for (int64_t t = j0; t < j0 + n8; t += 8) {                                         \
                if (gi == 0)                                                                    \
                    for (int64_t i = t + PREFETCH_KEYS; i < t + PREFETCH_KEYS + 8 && i < nk; i++) \
                        prefetch_row(kc + offs[i], row_bytes);                                  \
                _mm256_storeu_ps(sc + gi * lp + t, scores8_##NAME(kc, offs + t, q + gi * q_hs, d, scale)); \
            }                                                                                   \
    }                                                                                           \
    /* pass 2: softmax; the padding lanes get -inf, so e = 0 there */                           \
    for (int64_t gi = 0; gi < g; gi++) {                                                        \
        float *s = sc + gi * lp;                                                                \
        for (int64_t j = nk; j < lp; j++) s[j] = -INFINITY;                                    \
        __m256 m = _mm256_set1_ps(-INFINITY);                                                   \
        for (int64_t j = 0; j < lp; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));       \
        const __m256 mv = _mm256_set1_ps(hmax(m));                                              \
        __m256 sum = _mm256_setzero_ps();                                                       \
        for (int64_t j = 0; j < lp; j += 8) {                                                   \
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));                   \
            _mm256_storeu_ps(s + j, e);                                                         \
            sum = _mm256_add_ps(sum, e);                                                        \
        }                                                                                       \
        const __m256 tv = _mm256_set1_ps(hsum(sum));                                            \
        for (int64_t j = 0; j < lp; j += 8) _mm256_storeu_ps(s + j, _mm256_div_ps(_mm256_loadu_ps(s + j), tv)); \
    }                                                                                           \
    /* pass 3: weighted sum of the values, a chunk of keys at a time, dims in tiles of up to  \
     * 64, the D % 8 tail scalar; the first sweep over a chunk prefetches */                   \
    const int64_t nvec = d / 8;                                                                 \
    for (int64_t j0 = 0; j0 < nk; j0 += KEYS_CHUNK) {                                           \
        const int64_t n = nk - j0 < KEYS_CHUNK ? nk - j0 : KEYS_CHUNK;                          \
        const int64_t npf = nk - j0 - PREFETCH_KEYS < n ? nk - j0 - PREFETCH_KEYS : n;          \
        for (int64_t c = 0; c < nvec; c += 8)                                                   \
            for (int64_t gi = 0; gi < g; gi++)                                                  \
                accum_##NAME(vc, offs + j0, n, sc + gi * lp + j0, o + gi * d + 8 * c, 8 * c, j0 == 0, \
                             c == 0 && gi == 0 ? offs + j0 + PREFETCH_KEYS : NULL, npf, row_bytes, \
                             (int)(nvec - c < 8 ? nvec - c : 8));                               \
        for (int64_t gi = 0; gi < g; gi++) {                                                    \
            const float *w = sc + gi * lp + j0;                                                 \
            if (nvec == 0 && gi == 0)                                                           \
                for (int64_t j = 0; j < npf; j++) prefetch_row(vc + offs[j0 + j + PREFETCH_KEYS], row_bytes); \
            for (int64_t e = 8 * nvec; e < d; e++) {                                            \
                float a = j0 == 0 ? 0.0f : o[gi * d + e];                                       \
                for (int64_t j = 0; j < n; j++) a = fmaf(w[j], load1_##NAME(vc + offs[j0 + j] + e), a); \
                o[gi * d + e] = a;                                                              \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

ITEM(f32, float)
ITEM(f16, uint16_t)
ITEM(bf16, uint16_t)

/* ---- entry points ---- */

/* zllm_paged_decode_attention_<cache type>: n decode rows. Row r is query row
 * q_rows[r] (NULL: r) of q f32 [T, H, D] (token stride q_ts, head stride q_hs, elements),
 * sequence seqs[r] (NULL: r), i.e. block-table row block_tables + seqs[r] * bt_rs (int64
 * [S, MB]), with context length ctx_lens[r]; its output goes to the same row of out f32
 * [T, H, D] contiguous (other rows are not written). window 0: keys 0 .. L - 1, else
 * max(0, L - window) .. L - 1. Caches [NB, BS, Hkv, D] contiguous. threads: at most this
 * many OpenMP threads (one per (row, KV head) item at most). */
#define DECODE_ENTRY(NAME, CT)                                                                  \
void zllm_paged_decode_attention_##NAME(const float *q, int64_t q_ts, int64_t q_hs,             \
                                        const int64_t *q_rows, const int64_t *seqs, const int64_t *ctx_lens, \
                                        const int64_t *block_tables, int64_t bt_rs, int64_t mb,  \
                                        const CT *k_cache, const CT *v_cache, int64_t nb, int64_t bs, \
                                        int64_t n, int64_t h, int64_t hkv, int64_t d, int64_t window, \
                                        float scale, float *out, int threads) {                 \
    if (n <= 0 || h <= 0 || hkv <= 0 || d <= 0 || bs <= 0 || h % hkv) return;                   \
    const int64_t g = h / hkv, items = n * hkv;                                                 \
    int64_t max_lp = 8, work = 0;                                                               \
    for (int64_t r = 0; r < n; r++) {                                                           \
        const int64_t l = ctx_lens[r], lw = window > 0 && l > window ? window : l;              \
        const int64_t lp = (lw + 7) & ~(int64_t)7;                                              \
        if (lp > max_lp) max_lp = lp;                                                           \
        work += (lw > 0 ? lw : 0) * h * d;                                                      \
    }                                                                                           \
    int nth = threads < items ? threads : (int)items;                                          \
    nth = nth < MAX_THREADS ? nth : MAX_THREADS;                                                \
    nth = nth > 1 && work >= ATTENTION_PARALLEL_MIN ? nth : 1;                                  \
    _Pragma("omp parallel num_threads(nth) if (nth > 1)")                                      \
    {                                                                                           \
        /* per thread: offsets [max_lp] int64, then scores [G, max_lp] f32 */                 \
        int64_t *offs = scratch((size_t)((g + 2) * max_lp) * sizeof(float));                   \
        float *sc = offs ? (float *)(offs + max_lp) : NULL;                                     \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t it = 0; it < items; it++) {                                                \
            const int64_t r = it / hkv, hk = it % hkv;                                          \
            const int64_t row = q_rows ? q_rows[r] : r, s = seqs ? seqs[r] : r;                 \
            const int64_t l = ctx_lens[r], k0 = window > 0 && l > window ? l - window : 0;      \
            const int64_t *table = block_tables + s * bt_rs;                                    \
            float *o = out + (row * h + hk * g) * d;                                            \
            int ok = sc != NULL && l >= 1 && (l - 1) / bs < mb;                                 \
            for (int64_t b = k0 / bs; ok && b <= (l - 1) / bs; b++) ok = table[b] >= 0 && table[b] < nb; \
            if (!ok) {                                                                          \
                for (int64_t i = 0; i < g * d; i++) o[i] = NAN;                                 \
                continue;                                                                       \
            }                                                                                   \
            key_offsets(table, k0, l - k0, bs, hkv * d, hk * d, offs);                          \
            item_##NAME(q + row * q_ts + hk * g * q_hs, q_hs, k_cache, v_cache, offs, d, l - k0, g, scale, o, sc); \
        }                                                                                       \
    }                                                                                           \
}

DECODE_ENTRY(f32, float)
DECODE_ENTRY(f16, uint16_t)
DECODE_ENTRY(bf16, uint16_t)

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

/* zllm_kv_write_<cache type>: k, v f32 [T, Hkv, D] (token strides k_ts / v_ts, head strides
 * k_hs / v_hs, elements) into k_cache, v_cache [NB, BS, Hkv, D] contiguous at int64
 * slots[T] (block * BS + offset); slots < 0 (padding) or >= n_slots (NB * BS) are skipped.
 * threads: at most this many OpenMP threads, used from WRITE_PARALLEL_MIN values on. */
#define WRITE_ENTRY(NAME, CT)                                                                   \
void zllm_kv_write_##NAME(const float *k, int64_t k_ts, int64_t k_hs, const float *v, int64_t v_ts, \
                          int64_t v_hs, const int64_t *slots, int64_t t, int64_t hkv, int64_t d, \
                          CT *k_cache, CT *v_cache, int64_t n_slots, int threads) {             \
    int nth = threads < MAX_THREADS ? threads : MAX_THREADS;                                    \
    nth = t * hkv * d >= WRITE_PARALLEL_MIN && nth > 1 ? nth : 1;                               \
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")                                  \
    for (int64_t i = 0; i < t; i++) {                                                           \
        const int64_t slot = slots[i];                                                          \
        if (slot < 0 || slot >= n_slots) continue;                                              \
        for (int64_t hk = 0; hk < hkv; hk++) {                                                  \
            convert_row_##NAME(k_cache + (slot * hkv + hk) * d, k + i * k_ts + hk * k_hs, d);   \
            convert_row_##NAME(v_cache + (slot * hkv + hk) * d, v + i * v_ts + hk * v_hs, d);   \
        }                                                                                       \
    }                                                                                           \
}

WRITE_ENTRY(f32, float)
WRITE_ENTRY(f16, uint16_t)
WRITE_ENTRY(bf16, uint16_t)
