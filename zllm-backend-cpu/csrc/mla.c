/* Native Multi-head Latent Attention for decode steps, in the absorbed form: the latent write
 * and every decode row of a step in one call, reading the latent blocks in place from the
 * paged cache (DeepSeek-V2, arXiv:2405.04434 §2.1; the absorbed decode of vLLM's
 * MLACommonImpl and of DeepSeek's model.py with attn_impl="absorb").
 *
 * Layout: cache [NB, BS, W] contiguous, f32 / f16 / bf16, W = R + Dr: one row per token,
 * [c_kv (R) | rotated k_pe (Dr)]; the token at position p of a sequence lives in block
 * block_table[p / BS] at offset p % BS. q_nope [T, H, Dn] and q_pe [T, H, Dr] are f32 with a
 * token and a head stride of their own (views of one projected query work as they are);
 * w_uk f32 [H, Dn, R] and w_uv_t f32 [H, R, Dv] contiguous are kv_b_proj's halves (W_UK[h],
 * and W_UV[h] transposed), split once per weight by the caller.
 *
 * A decode row's H heads all read the one latent row per token (MQA over the latent), so
 * per row:
 *   phase A: q_lat[h] = [q_nope[h] . W_UK[h] (R) | q_pe[h] (Dr)], one W-wide query per head;
 *   phase B: decode attention of the H latent queries over the row's L cached rows, keys the
 *            whole W-wide rows, values their first R values -> lat[h] (R): paged.h's item,
 *            exactly as attention.c runs it for a GQA group (DK = W, DV = R);
 *   phase C: out[h] = lat[h] . W_UV[h]^T (Dv).
 * Phase A and C run per (head, block of ROWS_PER_ITEM rows), so a head's weights are read
 * from memory once per block (the block's rows find them in L2); phase B per (row, group of heads), the heads split into as many
 * groups as the threads need to have work when the rows are few (a group reads the row's
 * latent blocks once for all its heads).
 *
 * Numerics: f32 throughout, every value reduced in one fixed order that depends only on the
 * shapes and the row's own L (never on the thread count, the grouping or the other rows), so
 * a decode row's output is bit-identical whatever else is in the call (batch-invariant) and
 * for any thread count:
 *   phase A and C: per output element one FMA chain over the inner dim (Dn, R) in order,
 *          from zero (vecmat);
 *   phase B: attention.c's orders (scores: 8-lane FMA accumulators over the W values, then
 *          hsum8x8, then * scale; the softmax of exp8; per latent value one FMA chain over
 *          the keys in order).
 * Agreement with the f32 reference (zllm.domain.mla, either form) is ~1e-6.
 *
 * Latent write: each row of W f32 values converted to the cache's type (round to nearest
 * even, bit-identical to torch's .to(dtype) for finite values) at slot = block * BS + offset;
 * a negative slot (padding) or one past the cache's NB * BS slots is skipped.
 *
 * Checks: a decode row whose L is < 1, or whose context reaches a block-table entry outside
 * [0, NB) or past the table's MB columns, gets NaN for its output instead of a read outside the
 * cache (and so does one whose scratch cannot be allocated).
 *
 * Threads: OpenMP with the caller's thread count, and one for a call of fewer than
 * MLA_PARALLEL_MIN multiply-adds (a decode row of a tiny model: waking a thread costs more
 * than the work).
 */
#include "paged.h"

#define ROWS_PER_ITEM 8               /* decode rows sharing one read of a head's W_UK / W_UV */
#define MLA_PARALLEL_MIN (1 << 16)    /* multiply-adds a call needs before it uses threads */
#define LATENT_WRITE_PARALLEL_MIN (1 << 16)  /* values a latent write needs before it uses threads */

/* y[0 .. 8 NV) = sum over j < k of x[j] * m[j * ld ..]: one FMA chain per element, j in order. */
INLINE void vecmat_n(const float *x, int64_t k, const float *m, int64_t ld, float *y, const int NV) {
    __m256 a[8];
    for (int i = 0; i < NV; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        const __m256 xj = _mm256_broadcast_ss(x + j);
        const float *mj = m + j * ld;
        for (int i = 0; i < NV; i++) a[i] = _mm256_fmadd_ps(xj, _mm256_loadu_ps(mj + 8 * i), a[i]);
    }
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(y + 8 * i, a[i]);
}

/* y = x . m: x f32 [k], m f32 [k, n] contiguous, y f32 [n]; one FMA chain over k per element,
 * from zero; columns in tiles of up to 64 (the accumulators stay in registers). */
static void vecmat(const float *x, int64_t k, const float *m, int64_t n, float *y) {
    const int64_t nvec = n / 8;
    for (int64_t c = 0; c < nvec; c += 8) {
        switch (nvec - c < 8 ? nvec - c : 8) {
        case 1: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 1); break;
        case 2: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 2); break;
        case 3: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 3); break;
        case 4: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 4); break;
        case 5: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 5); break;
        case 6: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 6); break;
        case 7: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 7); break;
        default: vecmat_n(x, k, m + 8 * c, n, y + 8 * c, 8); break;
        }
    }
    for (int64_t e = 8 * nvec; e < n; e++) {
        float a = 0.0f;
        for (int64_t j = 0; j < k; j++) a = fmaf(x[j], m[j * n + e], a);
        y[e] = a;
    }
}

/* zllm_mla_decode_<cache type>: n decode rows. Row i is query row q_rows[i] (NULL: i) of
 * q_nope f32 [T, H, Dn] (token stride qn_ts, head stride qn_hs, elements) and q_pe f32
 * [T, H, Dr] (qp_ts, qp_hs), sequence seqs[i] (NULL: i), i.e. block-table row
 * block_tables + seqs[i] * bt_rs (int64 [S, MB]), with context length ctx_lens[i]; its output
 * goes to the same row of out f32 [T, H, Dv] contiguous (other rows are not written). cache
 * [NB, BS, R + Dr] contiguous; w_uk f32 [H, Dn, R], w_uv_t f32 [H, R, Dv] contiguous; q_lat
 * f32 [n, H, R + Dr] and lat f32 [n, H, R]: the caller's scratch. threads: at most this many
 * OpenMP threads. */
#define DECODE_ENTRY(NAME, CT)                                                                  \
void zllm_mla_decode_##NAME(const float *q_nope, int64_t qn_ts, int64_t qn_hs, const float *q_pe, \
                            int64_t qp_ts, int64_t qp_hs, const int64_t *q_rows, const int64_t *seqs, \
                            const int64_t *ctx_lens, const int64_t *block_tables, int64_t bt_rs, int64_t mb, \
                            const CT *cache, int64_t nb, int64_t bs, int64_t n, int64_t h, int64_t dn, \
                            int64_t dr, int64_t dv, int64_t r, const float *w_uk, const float *w_uv_t, \
                            float scale, float *q_lat, float *lat, float *out, int threads) {   \
    if (n <= 0 || h <= 0 || dn <= 0 || dr < 0 || dv <= 0 || r <= 0 || bs <= 0) return;         \
    const int64_t w = r + dr, blocks = (n + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;                 \
    int64_t max_lp = 8, work = n * h * (dn * r + r * dv);                                       \
    for (int64_t i = 0; i < n; i++) {                                                           \
        const int64_t l = ctx_lens[i], lp = (l + 7) & ~(int64_t)7;                              \
        if (lp > max_lp) max_lp = lp;                                                           \
        work += (l > 0 ? l : 0) * h * (w + r);                                                  \
    }                                                                                           \
    int nth = threads < MAX_THREADS ? threads : MAX_THREADS;                                    \
    nth = nth > 1 && work >= MLA_PARALLEL_MIN ? nth : 1;                                        \
    /* heads per phase-B item: all of them, unless the rows are too few to give every thread  \
     * one */                                                                                  \
    int64_t groups = 1;                                                                         \
    if (nth > n) groups = (nth + n - 1) / n < h ? (nth + n - 1) / n : h;                        \
    const int64_t hg = (h + groups - 1) / groups, n_groups = (h + hg - 1) / hg;                \
    _Pragma("omp parallel num_threads(nth) if (nth > 1)")                                      \
    {                                                                                           \
        /* phase A: q_lat[i, hd] = [q_nope . W_UK[hd] | q_pe] */                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t it = 0; it < h * blocks; it++) {                                           \
            const int64_t hd = it / blocks, i0 = it % blocks * ROWS_PER_ITEM;                   \
            const int64_t nr = n - i0 < ROWS_PER_ITEM ? n - i0 : ROWS_PER_ITEM;                 \
            for (int64_t i = i0; i < i0 + nr; i++) {                                            \
                const int64_t row = q_rows ? q_rows[i] : i;                                     \
                vecmat(q_nope + row * qn_ts + hd * qn_hs, dn, w_uk + hd * dn * r, r, q_lat + (i * h + hd) * w); \
                memcpy(q_lat + (i * h + hd) * w + r, q_pe + row * qp_ts + hd * qp_hs, (size_t)dr * sizeof(float)); \
            }                                                                                   \
        }                                                                                       \
        /* phase B: lat[i, heads of the group] = attention over the row's latent rows */       \
        int64_t *offs = scratch((size_t)((hg + 2) * max_lp) * sizeof(float));                  \
        float *sc = offs ? (float *)(offs + max_lp) : NULL;                                     \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t it = 0; it < n * n_groups; it++) {                                         \
            const int64_t i = it / n_groups, h0 = it % n_groups * hg;                          \
            const int64_t g = h - h0 < hg ? h - h0 : hg, s = seqs ? seqs[i] : i, l = ctx_lens[i]; \
            const int64_t *table = block_tables + s * bt_rs;                                    \
            float *o = lat + (i * h + h0) * r;                                                  \
            int ok = sc != NULL && l >= 1 && (l - 1) / bs < mb;                                 \
            for (int64_t b = 0; ok && b <= (l - 1) / bs; b++) ok = table[b] >= 0 && table[b] < nb; \
            if (!ok) {                                                                          \
                for (int64_t e = 0; e < g * r; e++) o[e] = NAN;                                 \
                continue;                                                                       \
            }                                                                                   \
            key_offsets(table, 0, l, bs, w, 0, offs);                                           \
            item_##NAME(q_lat + (i * h + h0) * w, w, cache, cache, offs, w, r, l, g, scale, NULL, o, sc); \
        }                                                                                       \
        /* phase C: out[row, hd] = lat[i, hd] . W_UV[hd]^T */                                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                 \
        for (int64_t it = 0; it < h * blocks; it++) {                                           \
            const int64_t hd = it / blocks, i0 = it % blocks * ROWS_PER_ITEM;                   \
            const int64_t nr = n - i0 < ROWS_PER_ITEM ? n - i0 : ROWS_PER_ITEM;                 \
            for (int64_t i = i0; i < i0 + nr; i++)                                              \
                vecmat(lat + (i * h + hd) * r, r, w_uv_t + hd * r * dv, dv,                     \
                       out + ((q_rows ? q_rows[i] : i) * h + hd) * dv);                         \
        }                                                                                       \
    }                                                                                           \
}

DECODE_ENTRY(f32, float)
DECODE_ENTRY(f16, uint16_t)
DECODE_ENTRY(bf16, uint16_t)

/* zllm_mla_latent_write_<cache type>: latent f32 [T, W] (token stride l_ts, elements) into
 * cache [NB, BS, W] contiguous at int64 slots[T] (block * BS + offset); slots < 0 (padding) or
 * >= n_slots (NB * BS) are skipped. threads: at most this many OpenMP threads, used from
 * LATENT_WRITE_PARALLEL_MIN values on. */
#define WRITE_ENTRY(NAME, CT)                                                                   \
void zllm_mla_latent_write_##NAME(const float *latent, int64_t l_ts, const int64_t *slots, int64_t t, \
                                  int64_t w, CT *cache, int64_t n_slots, int threads) {         \
    int nth = threads < MAX_THREADS ? threads : MAX_THREADS;                                    \
    nth = t * w >= LATENT_WRITE_PARALLEL_MIN && nth > 1 ? nth : 1;                              \
    _Pragma("omp parallel for num_threads(nth) if (nth > 1)")                                  \
    for (int64_t i = 0; i < t; i++) {                                                           \
        const int64_t slot = slots[i];                                                          \
        if (slot >= 0 && slot < n_slots) convert_row_##NAME(cache + slot * w, latent + i * l_ts, w); \
    }                                                                                           \
}

WRITE_ENTRY(f32, float)
WRITE_ENTRY(f16, uint16_t)
WRITE_ENTRY(bf16, uint16_t)
