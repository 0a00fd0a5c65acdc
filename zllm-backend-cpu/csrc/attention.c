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
 *
 * The item (key offsets, the three passes, scratch) is in paged.h, shared with mla.c.
 */
#include "paged.h"

#define WRITE_PARALLEL_MIN (1 << 16)  /* values a KV write needs before it uses threads */
#define ATTENTION_PARALLEL_MIN (1 << 16)  /* score multiply-adds (keys x H x D) a call needs before it
                                          * uses threads: below, waking a thread costs more than the work */

/* ---- entry points ---- */

/* zllm_paged_decode_attention_<cache type>: n decode rows. Row r is query row
 * q_rows[r] (NULL: r) of q f32 [T, H, D] (token stride q_ts, head stride q_hs, elements),
 * sequence seqs[r] (NULL: r), i.e. block-table row block_tables + seqs[r] * bt_rs (int64
 * [S, MB]), with context length ctx_lens[r]; its output goes to the same row of out f32
 * [T, H, D] contiguous (other rows are not written). window 0: keys 0 .. L - 1, else
 * max(0, L - window) .. L - 1. sinks f32 [H] (attention sinks, gpt-oss: head h's softmax
 * takes sinks[h] as one more logit, with no value) or NULL. Caches [NB, BS, Hkv, D]
 * contiguous. threads: at most this many OpenMP threads (one per (row, KV head) item at most). */
#define DECODE_ENTRY(NAME, CT)                                                                  \
void zllm_paged_decode_attention_##NAME(const float *q, int64_t q_ts, int64_t q_hs,             \
                                        const int64_t *q_rows, const int64_t *seqs, const int64_t *ctx_lens, \
                                        const int64_t *block_tables, int64_t bt_rs, int64_t mb,  \
                                        const CT *k_cache, const CT *v_cache, int64_t nb, int64_t bs, \
                                        int64_t n, int64_t h, int64_t hkv, int64_t d, int64_t window, \
                                        const float *sinks, float scale, float *out, int threads) { \
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
            item_##NAME(q + row * q_ts + hk * g * q_hs, q_hs, k_cache, v_cache, offs, d, d, l - k0, g, scale, \
                        sinks ? sinks + hk * g : NULL, o, sc);                                  \
        }                                                                                       \
    }                                                                                           \
}

DECODE_ENTRY(f32, float)
DECODE_ENTRY(f16, uint16_t)
DECODE_ENTRY(bf16, uint16_t)


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
