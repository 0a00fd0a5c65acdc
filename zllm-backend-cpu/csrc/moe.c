/* Native Mixture-of-Experts FFN: one call per layer runs every selected expert of every token
 * (gate and up GEMV, the gated activation, down GEMV), the weighted sum and the shared expert,
 * with the weights in their stored formats (gemv.h: f32, f16, bf16, GGUF Q8_0 / Q4_0 / Q4_1 /
 * Q5_0 / Q5_1 and the k-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K; quant_gemv.h: the HF kernel
 * layouts FP8 E4M3, INT4 / INT8 in groups, MXFP4 (gpt-oss's experts, HF or GGUF) and NVFP4)
 * and optional f32 biases per expert and matrix. The activation is SiLU-and-mul
 * (silu(g) * u) or gpt-oss's clamped SwiGLU ((clamp(u, -limit, limit) + 1) * c *
 * sigmoid(alpha c), c = min(g, limit); zllm.domain.moe_biased:moe_clamped_swiglu). The routing
 * (which experts, which weights) comes from the caller: the core's f32 router decides it, so every backend agrees on
 * the experts. As llama.cpp's mul_mat_id (ggml-cpu.c): the (token, slot) pairs are bucketed by
 * expert, and only the selected experts' rows are read, each once per call for all the tokens
 * that selected it.
 *
 * Dimension legend: T tokens, K hidden size, E routed experts, k experts per token, N expert
 * width, Ns shared-expert width, P = T * k routed pairs (+ T shared pairs).
 *
 * Operands: x [T, K] f32 (row stride xs); ids int64 [T, k] and weights f32 [T, k] (the router's
 * top-k); six weight matrices described by desc int64 [6][DESC_FIELDS] (the D_* fields
 * below: address, expert stride in bytes, row stride (elements; bytes for the block formats
 * and the HF layouts), format (gemv.h's enum, then GEMV_NFORMATS + the HF layout in
 * HF_LAYOUTS' order), the HF layouts' other parts (scales, zero points, NVFP4's global scale,
 * each an address and an expert stride in bytes), group size and FP8's row block, and the
 * bias (f32 [E, rows], address 0: none)): routed gate [E, N, K], up [E, N, K], down [E, K, N],
 * then the shared expert's gate [Ns, K], up [Ns, K], down [K, Ns] (address 0: no shared
 * expert); shared_scale [T] f32 multiplies the shared expert's output (Qwen2-MoE's sigmoid
 * gate), or NULL for 1; act: MOE_SILU_MUL or MOE_SWIGLU_CLAMPED (with alpha and limit); out
 * [T, K] f32.
 *
 * Steps:
 *   A. bucket (one thread): pairs sorted by expert, stable (a token's pairs keep their slot
 *      order within an expert), so expert e's pairs are one contiguous run; x gathered per pair
 *      in that order (and quantized per row of 32 when a gate / up matrix is a block format,
 *      prepared by quant_gemv.h's plan when an HF layout's row kernel takes x prepared);
 *   B. per (expert, tile of gate / up rows), on the team: gate and up rows (+ bias) for the
 *      expert's pairs (gemv.h's or quant_gemv.h's row kernels, each weight row read once for
 *      all of them; GATE_UP_ROWS gate rows, then as many up rows, so both streams stay
 *      prefetched), then the activation on the tile: h = g / (1 + e^-g) * u, or the clamped
 *      SwiGLU in the reference's order (c = min(g, limit); s = 1 / (1 + e^-(c alpha));
 *      (clamp(u) + 1) * (s * c)), with common.h's exp8 in every lane (a padded tail too), so
 *      an element's value does not depend on where a tile boundary falls;
 *   C. h quantized (block-format down matrices) or prepared (HF layouts whose rows take a
 *      prepared x) per pair, by the first D item of the expert;
 *   D. per (expert, tile of down rows), on the team: y = down . h (+ bias) for the expert's
 *      pairs, once that expert's B items are done (no barrier between B and D);
 *   E. per token (one thread): out = w_0 y_0 + w_1 y_1 + ... over its pairs in ascending
 *      expert index (ties in slot order), each product rounded before its add (the
 *      reference's order: the weighted rows, then one add per slot), then + scale * the
 *      shared expert's y.
 *
 * Numerics: every value is gemv.c's or quant_gemv.c's (the same row kernels, one fixed
 * reduction order per format and length; a bias added to the row's sum, as there) followed by
 * fixed elementwise steps; x and h are quantized or prepared per pair row, from that row
 * alone. So a token's output is bit-identical whatever else is in the call
 * (batch-invariant), for any thread count and tile split.
 *
 * Threads: OpenMP with the caller's thread count, one when the selected weights are under
 * PARALLEL_MIN_BYTES (a tiny model: waking a thread costs more than the work). The work items
 * of B and D (about ITEM_BYTES of weights each, expert-major) are cut into one contiguous
 * region per thread; a thread takes its own region front to back (one stream through the
 * weights), then helps with the others' (gemv.c's split), so a descheduled thread on a busy
 * machine delays one item, not its share. The only waits are a D item's for its expert's B
 * items and the team's end (not libgomp's barriers: 4 of them cost 4-5x the one-thread CPU
 * time of a 16-token Qwen3-MoE layer with 2 threads at load 9 on 2 cores; this layout 2x).
 * A wait spins on `pause` for SPIN_PAUSES (~60 us here: a running team mate finishes an item
 * of 64 KB in a few us), then yields the CPU (sched_yield) each round, for a team mate that the
 * OS descheduled. Yielding at once handed the core to another process for its time slice at
 * every wait: at T = 1 with 2 threads at load 5-6 on 2 cores the call's best of 21 rounds was
 * 3.8 ms against 0.85 ms for spinning first (the native GEMV of the same bytes: 0.83 ms).
 *
 * Scratch: one block per call from the calling thread's arena (kept up to ARENA_KEEP_BYTES).
 *
 * Checks: an expert id outside [0, E), a format number outside the table, or scratch that
 * cannot be allocated, makes the whole output NaN instead of a read outside the weights.
 */
#define _POSIX_C_SOURCE 200809L /* sched_yield */
#include "common.h"
#include "gemv.h"
#include "quant_gemv.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

#define ITEM_BYTES (64 << 10)          /* weight bytes per work item */
#define PARALLEL_MIN_BYTES (256 << 10) /* selected weight bytes a call needs before it uses threads */
#define ARENA_KEEP_BYTES (4 << 20)     /* scratch kept between calls, per calling thread */
#define GATE_UP_ROWS 4                 /* gate rows, then as many up rows, in step B */

/* A wait's pause instructions before it yields (~28 ns each on the benchmark machine's EPYC). */
#define SPIN_PAUSES 2000

/* Waits until cond holds: spinning first, then yielding (file comment, Threads). */
#define WAIT_UNTIL(cond)                                                                       \
    for (int spins_ = 0; !(cond); spins_++) {                                                  \
        if (spins_ < SPIN_PAUSES) _mm_pause();                                                 \
        else sched_yield();                                                                    \
    }

enum { GATE, UP, DOWN };

/* The activation between gate / up and down (zllm_backend_cpu.kernels.moe_gemv's numbers). */
enum { MOE_SILU_MUL = 0, MOE_SWIGLU_CLAMPED = 1 };

/* A matrix's row in desc (file comment); the HF parts and the bias are 0 where unused. */
enum { D_ADDR, D_EXPERT_STRIDE, D_ROW_STRIDE, D_FORMAT, D_SCALES, D_SCALES_STRIDE, D_ZEROS, D_ZEROS_STRIDE,
       D_GLOBAL, D_GLOBAL_STRIDE, D_GROUP, D_ROW_BLOCK, D_BIAS, D_BIAS_STRIDE, DESC_FIELDS };

/* The HF layouts in the order of zllm_backend_cpu.kernels.QUANT_GEMV_FORMATS (format numbers
 * GEMV_NFORMATS + i). */
static const int HF_LAYOUTS[] = {L_FP8, L_INT4, L_INT8, L_MXFP4, L_NVFP4};
enum { HF_NLAYOUTS = sizeof HF_LAYOUTS / sizeof HF_LAYOUTS[0] };

/* The HF layout of a format number, or -1 for gemv.h's formats. */
static int hf_layout(int format) { return format >= GEMV_NFORMATS ? HF_LAYOUTS[format - GEMV_NFORMATS] : -1; }

/* Whether a format takes x quantized to int16 per block of 32 (gemv.h's block formats). */
static int takes_xq(int format) { return format < GEMV_NFORMATS && gemv_is_block(format); }

/* Expert e of the matrix whose desc row is d ([rows, cols] an expert, an HF layout) as a qweight. */
static qweight hf_weight(const int64_t *d, int64_t e, int64_t rows, int64_t cols) {
    const int64_t g = d[D_GROUP] > 0 ? d[D_GROUP] : 1;
    const float *global = (const float *)(uintptr_t)(d[D_GLOBAL] ? d[D_GLOBAL] + e * d[D_GLOBAL_STRIDE] : 0);
    return (qweight){(const uint8_t *)(uintptr_t)(d[D_ADDR] + e * d[D_EXPERT_STRIDE]),
                     (const void *)(uintptr_t)(d[D_SCALES] + e * d[D_SCALES_STRIDE]),
                     (const uint8_t *)(uintptr_t)(d[D_ZEROS] ? d[D_ZEROS] + e * d[D_ZEROS_STRIDE] : 0),
                     global ? *global : 0.0f, rows, cols, g, d[D_ROW_BLOCK] > 0 ? d[D_ROW_BLOCK] : 1,
                     d[D_ROW_STRIDE], (cols + g - 1) / g};
}

/* Bytes a row of `cols` weights reads in matrix d's format (the HF layouts: quants, scales and
 * zero points), for sizing work items. */
static int64_t row_bytes(const int64_t *d, int64_t cols) {
    const int fmt = (int)d[D_FORMAT], layout = hf_layout(fmt);
    if (layout < 0) return gemv_row_bytes(fmt, cols);
    const int64_t g = d[D_GROUP] > 0 ? d[D_GROUP] : 1, ng = (cols + g - 1) / g;
    const int64_t per_group = layout == L_FP8 ? 4 : layout == L_INT4 || layout == L_INT8 ? 5 : 1;
    return (layout == L_INT4 || layout == L_MXFP4 || layout == L_NVFP4 ? (cols + 1) / 2 : cols) + ng * per_group;
}

/* One expert's run of pairs [p0, p1) and its three matrices; its pairs' h rows (width wide)
 * start at hoff. */
typedef struct {
    const uint8_t *w[3];
    int64_t ws[3];
    int fmt[3];
    const float *bias[3];
    qweight qw[3];     /* HF layouts: the expert's weight */
    qgemv_plan plan[3]; /* HF layouts: its row kernel */
    int64_t width, p0, p1, hoff, hsoff; /* hsoff: first of its pairs' h scales (block-format down) */
    int64_t hdoff;     /* its pairs' prepared h (HF down whose rows take it), plan[DOWN].xds apart */
} job;

typedef struct {
    const job *jobs;
    const int32_t *item_job; /* B, then D: the job and first row of each item */
    const int64_t *item_row;
    int64_t items_b, rows_b_max, rows_d_max;
    const float *xg;
    const int16_t *xq;
    const float *xsc;
    const float *xd[2]; /* gate / up: x prepared per pair (HF plans with a prep), xds[m] apart */
    int64_t xds[2];
    float *g, *u;
    int16_t *hq;
    float *hsc;
    float *hd;
    float *yd;
    int64_t k;
    int act;
    float alpha, limit;
    int64_t *b_left; /* per job: gate / up items not finished yet */
    int *h_state;    /* per job: its h quantized? 0 no, 1 in progress, 2 yes */
} moe_ctx;

/* h = silu(g) * u over n values; the last n % 8 through a padded vector, as the others. */
static void silu_mul_n(float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 vg = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_xor_ps(vg, sign));
        _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    if (j < n) {
        float tg[8] = {0}, tu[8] = {0};
        memcpy(tg, g + j, (size_t)(n - j) * sizeof(float));
        memcpy(tu, u + j, (size_t)(n - j) * sizeof(float));
        const __m256 vg = _mm256_loadu_ps(tg);
        const __m256 e = exp8(_mm256_xor_ps(vg, sign));
        _mm256_storeu_ps(tg, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(tu)));
        memcpy(g + j, tg, (size_t)(n - j) * sizeof(float));
    }
}

/* h = (clamp(u, -limit, limit) + 1) * (sigmoid(c alpha) * c), c = min(g, limit), over n values,
 * in the reference's order (moe_biased.swiglu_clamped: the sigmoid of c * alpha, times c, times
 * the clamped up + 1); the last n % 8 through a padded vector, as the others. */
static void swiglu_clamped_n(float *g, const float *u, int64_t n, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), va = _mm256_set1_ps(alpha);
    const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    for (int64_t j = 0; j < n; j += 8) {
        float tg[8] = {0}, tu[8] = {0};
        const int full = j + 8 <= n;
        if (!full) {
            memcpy(tg, g + j, (size_t)(n - j) * sizeof(float));
            memcpy(tu, u + j, (size_t)(n - j) * sizeof(float));
        }
        /* min / max with the operand first keep a NaN pre-activation NaN, as torch's clamp */
        const __m256 vc = _mm256_min_ps(full ? _mm256_loadu_ps(g + j) : _mm256_loadu_ps(tg), hi);
        const __m256 vu = _mm256_max_ps(_mm256_min_ps(full ? _mm256_loadu_ps(u + j) : _mm256_loadu_ps(tu), hi), lo);
        const __m256 e = exp8(_mm256_xor_ps(_mm256_mul_ps(vc, va), sign));
        const __m256 glu = _mm256_mul_ps(_mm256_div_ps(one, _mm256_add_ps(one, e)), vc);
        const __m256 h = _mm256_mul_ps(_mm256_add_ps(vu, one), glu);
        if (full) _mm256_storeu_ps(g + j, h);
        else {
            _mm256_storeu_ps(tg, h);
            memcpy(g + j, tg, (size_t)(n - j) * sizeof(float));
        }
    }
}

/* Matrix m of job jb bound to its operands for the job's pairs: x [np, cols] (row stride xs;
 * for gemv.h's block formats xq / xsc instead) -> y [np, rows] (+ bias). Set up once per work
 * item; mat_rows then runs a range of rows by the matrix's row kernel. */
typedef struct {
    const job *jb;
    int m;
    gemv_args a; /* gemv.h's formats */
    rows_fn rows;
    const float *x; /* the HF layouts */
    int64_t xs;
    float *y;
} mat_call;

static mat_call bind_mat(const job *jb, int m, const float *x, int64_t xs, const int16_t *xq, const float *xsc,
                         float *y, int64_t rows, int64_t cols) {
    const int block = takes_xq(jb->fmt[m]), hf = hf_layout(jb->fmt[m]) >= 0;
    const gemv_args a = {jb->w[m], jb->ws[m], block ? 0 : x, xs, block ? (int16_t *)xq : 0, block ? (float *)xsc : 0,
                         jb->bias[m], y, jb->p1 - jb->p0, rows, cols};
    return (mat_call){jb, m, a, hf ? 0 : gemv_rows(jb->fmt[m]), x, xs, y};
}

INLINE void mat_rows(const mat_call *mc, int64_t r0, int64_t r1) {
    if (mc->rows) mc->rows(&mc->a, r0, r1);
    else mc->jb->plan[mc->m].rows(&mc->jb->qw[mc->m], r0, r1, mc->x, mc->xs, mc->jb->bias[mc->m], mc->y, mc->a.t);
}

/* Step B, one item: gate and up rows [r0, r1) of job j for its pairs, then the activation. */
static void item_gate_up(const moe_ctx *c, int64_t item) {
    const job *jb = c->jobs + c->item_job[item];
    const int64_t r0 = c->item_row[item], r1 = r0 + c->rows_b_max < jb->width ? r0 + c->rows_b_max : jb->width;
    const int64_t np = jb->p1 - jb->p0, k = c->k;
    const float *x[2];
    int64_t xs[2];
    for (int m = GATE; m <= UP; m++) {
        const int prepared = hf_layout(jb->fmt[m]) >= 0 && jb->plan[m].prep;
        x[m] = prepared ? c->xd[m] + jb->p0 * c->xds[m] : c->xg ? c->xg + jb->p0 * k : 0;
        xs[m] = prepared ? c->xds[m] : k;
    }
    const int16_t *xq = c->xq ? c->xq + jb->p0 * k : 0;
    const float *xsc = c->xsc ? c->xsc + jb->p0 * (k / 32) : 0;
    /* gate and up a few rows at a time: two streams advancing together, each prefetched ahead
     * by the row kernel, instead of one cold start in the middle of the item */
    const mat_call gate = bind_mat(jb, GATE, x[GATE], xs[GATE], xq, xsc, c->g + jb->hoff, jb->width, k);
    const mat_call up = bind_mat(jb, UP, x[UP], xs[UP], xq, xsc, c->u + jb->hoff, jb->width, k);
    for (int64_t r = r0; r < r1; r += GATE_UP_ROWS) {
        const int64_t e = r + GATE_UP_ROWS < r1 ? r + GATE_UP_ROWS : r1;
        mat_rows(&gate, r, e);
        mat_rows(&up, r, e);
    }
    for (int64_t p = 0; p < np; p++) {
        float *g = c->g + jb->hoff + p * jb->width + r0;
        const float *u = c->u + jb->hoff + p * jb->width + r0;
        if (c->act == MOE_SWIGLU_CLAMPED) swiglu_clamped_n(g, u, r1 - r0, c->alpha, c->limit);
        else silu_mul_n(g, u, r1 - r0);
    }
    __atomic_sub_fetch(&c->b_left[c->item_job[item]], 1, __ATOMIC_ACQ_REL); /* publishes this tile of h */
}

/* Step D, one item: down rows [r0, r1) of job j for its pairs -> yd, once j's h is complete
 * (and, for a block-format down matrix, quantized: step C, by the first item of j to get
 * there). A thread reaches D only when every B item has been taken, so it waits only for
 * items another thread is running (WAIT_UNTIL). */
static void item_down(const moe_ctx *c, int64_t item) {
    const int j = c->item_job[item];
    const job *jb = c->jobs + j;
    const int64_t k = c->k, n = jb->width, np = jb->p1 - jb->p0;
    const int64_t r0 = c->item_row[item], r1 = r0 + c->rows_d_max < k ? r0 + c->rows_d_max : k;
    const int block = takes_xq(jb->fmt[DOWN]);
    const int prepared = hf_layout(jb->fmt[DOWN]) >= 0 && jb->plan[DOWN].prep;
    const int64_t xds = prepared ? jb->plan[DOWN].xds : n;
    WAIT_UNTIL(__atomic_load_n(&c->b_left[j], __ATOMIC_ACQUIRE) <= 0);
    if (block || prepared) {
        int idle = 0;
        if (__atomic_compare_exchange_n(&c->h_state[j], &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            if (block) gemv_quantize_rows(c->g + jb->hoff, n, np, n, c->hq + jb->hoff, c->hsc + jb->hsoff);
            else jb->plan[DOWN].prep(&jb->qw[DOWN], c->g + jb->hoff, n, np, c->hd + jb->hdoff, xds);
            __atomic_store_n(&c->h_state[j], 2, __ATOMIC_RELEASE);
        } else {
            WAIT_UNTIL(__atomic_load_n(&c->h_state[j], __ATOMIC_ACQUIRE) == 2);
        }
    }
    const mat_call down = bind_mat(jb, DOWN, prepared ? c->hd + jb->hdoff : c->g + jb->hoff, xds,
                                   block ? c->hq + jb->hoff : 0, block ? c->hsc + jb->hsoff : 0, c->yd + jb->p0 * k, k, n);
    mat_rows(&down, r0, r1);
}

/* Items [first, first + n) over the team: region i = items [i * per, (i + 1) * per), taken by
 * thread i front to back, then by the others; next[i] starts at region i's first item. */
static void take_items(const moe_ctx *c, void (*fn)(const moe_ctx *, int64_t), int64_t first, int64_t n,
                       int nreg, int64_t *next) {
    const int64_t per = (n + nreg - 1) / nreg;
    const int id = omp_get_thread_num();
    for (int v = 0; v < nreg; v++) {
        const int region = (id + v) % nreg;
        const int64_t end = (region + 1) * per < n ? (region + 1) * per : n;
        for (;;) {
            const int64_t i = __atomic_fetch_add(&next[region], 1, __ATOMIC_RELAXED);
            if (i >= end) break;
            fn(c, first + i);
        }
    }
}

/* A call's scratch (`bytes` a multiple of 64): the calling thread's arena, grown to twice the
 * largest call up to ARENA_KEEP_BYTES and kept for the thread's life (a decode step's MoE calls
 * then neither allocate nor fault pages in: at 16 tokens a Qwen3-MoE layer's 1.3 MB from malloc
 * were ~10 fresh pages a call), or for a larger call (a prefill chunk) its own block, freed by
 * scratch_done. NULL when it cannot be allocated. */
static _Thread_local struct {
    unsigned char *base;
    size_t bytes;
} arena;

static unsigned char *scratch(size_t bytes) {
    if (bytes > ARENA_KEEP_BYTES) return aligned_alloc(64, bytes);
    if (bytes > arena.bytes) {
        const size_t grown = 2 * bytes < ARENA_KEEP_BYTES ? 2 * bytes : ARENA_KEEP_BYTES;
        free(arena.base);
        arena.base = aligned_alloc(64, grown);
        arena.bytes = arena.base ? grown : 0;
    }
    return arena.base;
}

static void scratch_done(unsigned char *base) {
    if (base != arena.base) free(base);
}

static void fill_nan(float *out, int64_t t, int64_t k) {
    for (int64_t i = 0; i < t * k; i++) out[i] = NAN;
}

void zllm_moe(const float *x, int64_t xs, int64_t t, int64_t k, const int64_t *ids, const float *weights,
              int64_t top_k, int64_t n_experts, int64_t width, const int64_t *desc, int64_t shared_width,
              const float *shared_scale, int act, float alpha, float limit, float *out, int threads) {
    if (t <= 0 || k <= 0) return;
    const int shared = desc[3 * DESC_FIELDS + D_ADDR] != 0, nmat = shared ? 6 : 3;
    const int64_t pairs = t * top_k, ptot = pairs + (shared ? t : 0);
    for (int64_t i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] >= n_experts) {
            fill_nan(out, t, k);
            return;
        }
    for (int m = 0; m < nmat; m++) {
        const int64_t fmt = desc[m * DESC_FIELDS + D_FORMAT];
        if (fmt < 0 || fmt >= GEMV_NFORMATS + HF_NLAYOUTS) {
            fill_nan(out, t, k);
            return;
        }
    }
    /* the HF matrices' plans (they depend on the shape, group size and ISA level only) */
    qgemv_plan plan[6] = {{0}};
    for (int m = 0; m < nmat; m++) {
        const int64_t *d = desc + m * DESC_FIELDS;
        const int layout = hf_layout((int)d[D_FORMAT]), routed = m < 3;
        const int64_t wdt = routed ? width : shared_width;
        if (layout < 0) continue;
        const qweight shape = hf_weight(d, 0, m % 3 == DOWN ? k : wdt, m % 3 == DOWN ? wdt : k);
        plan[m] = qgemv_plan_of(&shape, layout);
    }
    int need_xf = 0, need_xq = 0, need_hq = 0;
    int64_t xds[2] = {0, 0}; /* floats of a pair's prepared x for gate / up (the routed and shared plans' most) */
    for (int m = 0; m < nmat; m++) {
        const int fmt = (int)desc[m * DESC_FIELDS + D_FORMAT], hf = hf_layout(fmt) >= 0;
        if (m % 3 == DOWN) need_hq |= takes_xq(fmt);
        else if (hf && plan[m].prep) {
            if (plan[m].xds > xds[m % 3]) xds[m % 3] = plan[m].xds;
        } else if (takes_xq(fmt)) need_xq = 1;
        else need_xf = 1;
    }
    /* up's x prepared as gate's (the same plans): one buffer */
    const int up_as_gate = plan[UP].prep == plan[GATE].prep && plan[UP].xds == plan[GATE].xds &&
                           plan[3 + UP].prep == plan[3 + GATE].prep && plan[3 + UP].xds == plan[3 + GATE].xds;
    const int64_t htot = pairs * width + (shared ? t * shared_width : 0);
    /* prepared h (HF down matrices whose rows take it): each pair's row of its plan's xds floats */
    const int64_t hd_floats = pairs * (plan[DOWN].prep ? plan[DOWN].xds : 0) +
                              (shared && plan[3 + DOWN].prep ? t * plan[3 + DOWN].xds : 0);
    const int64_t gu_bytes = row_bytes(desc + GATE * DESC_FIELDS, k) + row_bytes(desc + UP * DESC_FIELDS, k);
    const int64_t d_bytes = row_bytes(desc + DOWN * DESC_FIELDS, width);
    const int64_t rows_b = ITEM_BYTES / (gu_bytes > 0 ? gu_bytes : 1) > 8 ? ITEM_BYTES / gu_bytes : 8;
    const int64_t rows_d = ITEM_BYTES / (d_bytes > 0 ? d_bytes : 1) > 8 ? ITEM_BYTES / d_bytes : 8;
    /* at most one job per pair (and the shared expert), each cut into items as below */
    const int64_t jobs_max = (pairs < n_experts ? pairs : n_experts) + 1;
    const int64_t widest = shared && shared_width > width ? shared_width : width;
    const int64_t items_max = jobs_max * ((widest + rows_b - 1) / rows_b + (k + rows_d - 1) / rows_d);

    /* the scratch, one block in this order (each part 64-byte aligned) */
    const size_t sizes[] = {
        (size_t)(n_experts + 1) * sizeof(int64_t),                /* count */
        (size_t)n_experts * sizeof(int64_t),                      /* fill */
        (size_t)t * sizeof(int64_t),                              /* seen */
        (size_t)ptot * sizeof(int64_t),                           /* pair_of */
        (size_t)ptot * sizeof(int64_t),                           /* tok_pairs */
        (size_t)jobs_max * sizeof(job),                           /* jobs */
        need_xf ? (size_t)(ptot * k) * sizeof(float) : 0,         /* xg */
        need_xq ? (size_t)(ptot * k) * sizeof(int16_t) : 0,       /* xq */
        need_xq ? (size_t)(ptot * (k / 32)) * sizeof(float) : 0,  /* xsc */
        (size_t)htot * sizeof(float),                             /* g */
        (size_t)htot * sizeof(float),                             /* u */
        need_hq ? (size_t)htot * sizeof(int16_t) : 0,             /* hq */
        need_hq ? (size_t)(htot / 32 + 1) * sizeof(float) : 0,    /* hsc */
        (size_t)(ptot * k) * sizeof(float),                       /* yd */
        (size_t)items_max * sizeof(int32_t),                      /* item_job */
        (size_t)items_max * sizeof(int64_t),                      /* item_row */
        (size_t)jobs_max * sizeof(int64_t),                       /* b_left */
        (size_t)jobs_max * sizeof(int),                           /* h_state */
        (size_t)(ptot * xds[GATE]) * sizeof(float),               /* xd gate */
        up_as_gate ? 0 : (size_t)(ptot * xds[UP]) * sizeof(float), /* xd up */
        (size_t)hd_floats * sizeof(float),                        /* hd */
    };
    enum { NPARTS = sizeof sizes / sizeof sizes[0] };
    size_t offsets[NPARTS + 1] = {0};
    for (int i = 0; i < NPARTS; i++) offsets[i + 1] = offsets[i] + (sizes[i] + 63) / 64 * 64;
    unsigned char *base = scratch(offsets[NPARTS]);
    if (!base) {
        fill_nan(out, t, k);
        return;
    }
    void *part[NPARTS];
    for (int i = 0; i < NPARTS; i++) part[i] = sizes[i] ? base + offsets[i] : 0;
    int64_t *count = part[0], *fill = part[1], *seen = part[2];
    int64_t *pair_of = part[3];   /* bucket position -> flat (token, slot) */
    int64_t *tok_pairs = part[4]; /* token's bucket positions, in order */
    job *jobs = part[5];
    float *xg = part[6], *xsc = part[8], *g = part[9], *u = part[10], *hsc = part[12], *yd = part[13];
    int16_t *xq = part[7], *hq = part[11];
    int32_t *item_job = part[14];
    int64_t *item_row = part[15], *b_left = part[16];
    int *h_state = part[17];
    float *xd[2] = {part[18], up_as_gate ? part[18] : part[19]}, *hd = part[20];
    if (up_as_gate) xds[UP] = xds[GATE];
    memset(count, 0, sizes[0]);
    memset(seen, 0, sizes[2]);
    memset(h_state, 0, sizes[17]);

    /* counting sort of the pairs by expert (stable) */
    for (int64_t i = 0; i < pairs; i++) count[ids[i] + 1]++;
    for (int64_t e = 0; e < n_experts; e++) count[e + 1] += count[e]; /* count[e]: first position of e */
    memcpy(fill, count, (size_t)n_experts * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; i++) pair_of[fill[ids[i]]++] = i;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t tok = pair_of[p] / top_k;
        tok_pairs[tok * top_k + seen[tok]++] = p;
    }

    /* jobs: the selected experts in ascending index, then the shared expert */
    int njobs = 0;
    int64_t hoff = 0, hsoff = 0, hdoff = 0, items_b = 0, items_d = 0, selected_bytes = 0;
    for (int64_t e = 0; e <= n_experts; e++) {
        const int is_shared = e == n_experts;
        if (is_shared ? !shared : count[e + 1] == count[e]) continue;
        job *jb = jobs + njobs++;
        const int64_t ei = is_shared ? 0 : e, jw = is_shared ? shared_width : width;
        for (int m = 0; m < 3; m++) {
            const int64_t *d = desc + (is_shared ? 3 + m : m) * DESC_FIELDS;
            const int64_t rows = m == DOWN ? k : jw, cols = m == DOWN ? jw : k;
            jb->w[m] = (const uint8_t *)(uintptr_t)(d[D_ADDR] + ei * d[D_EXPERT_STRIDE]);
            jb->ws[m] = d[D_ROW_STRIDE];
            jb->fmt[m] = (int)d[D_FORMAT];
            jb->bias[m] = (const float *)(uintptr_t)(d[D_BIAS] ? d[D_BIAS] + ei * d[D_BIAS_STRIDE] : 0);
            jb->plan[m] = plan[(is_shared ? 3 : 0) + m];
            if (hf_layout(jb->fmt[m]) >= 0) jb->qw[m] = hf_weight(d, ei, rows, cols);
            selected_bytes += rows * row_bytes(d, cols);
        }
        jb->width = jw;
        jb->p0 = is_shared ? pairs : count[e];
        jb->p1 = is_shared ? ptot : count[e + 1];
        jb->hoff = hoff;
        jb->hsoff = hsoff;
        jb->hdoff = hdoff;
        hoff += (jb->p1 - jb->p0) * jb->width;
        hsoff += (jb->p1 - jb->p0) * (jb->width / 32);
        if (hf_layout(jb->fmt[DOWN]) >= 0 && jb->plan[DOWN].prep) hdoff += (jb->p1 - jb->p0) * jb->plan[DOWN].xds;
        items_b += (jb->width + rows_b - 1) / rows_b;
        items_d += (k + rows_d - 1) / rows_d;
    }
    /* a shared expert of another width takes the routed experts' rows per item: fine for the
     * split, which only needs items of similar size */
    {
        int64_t i = 0;
        for (int j = 0; j < njobs; j++)
            for (int64_t r = 0; r < jobs[j].width; r += rows_b) item_job[i] = j, item_row[i++] = r;
        for (int j = 0; j < njobs; j++)
            for (int64_t r = 0; r < k; r += rows_d) item_job[i] = j, item_row[i++] = r;
    }
    for (int64_t p = pairs; p < ptot; p++) pair_of[p] = -1 - (p - pairs); /* shared pair of token p - pairs */

    /* A: x gathered (quantized, prepared) per pair in bucket order; on one thread, as E: a few
     * microseconds a decode step, and no barrier for a descheduled thread to hold up. A token
     * is quantized at its first pair (the lowest bucket position) and copied to the others; a
     * prepared x is prepared per pair (the routed and the shared expert's plans may differ). */
    for (int64_t p = 0; p < ptot; p++) {
        const int64_t tok = pair_of[p] >= 0 ? pair_of[p] / top_k : -1 - pair_of[p];
        const int64_t first = top_k > 0 ? tok_pairs[tok * top_k] : p;
        if (need_xf) memcpy(xg + p * k, x + tok * xs, (size_t)k * sizeof(float));
        if (need_xq && first == p) gemv_quantize_rows(x + tok * xs, xs, 1, k, xq + p * k, xsc + p * (k / 32));
        else if (need_xq) {
            memcpy(xq + p * k, xq + first * k, (size_t)k * sizeof(int16_t));
            memcpy(xsc + p * (k / 32), xsc + first * (k / 32), (size_t)(k / 32) * sizeof(float));
        }
        for (int m = GATE; m <= (up_as_gate ? GATE : UP); m++) {
            const int mi = (p < pairs ? 0 : 3) + m;
            if (hf_layout((int)desc[mi * DESC_FIELDS + D_FORMAT]) < 0 || !plan[mi].prep) continue;
            const qweight shape = hf_weight(desc + mi * DESC_FIELDS, 0, p < pairs ? width : shared_width, k);
            plan[mi].prep(&shape, x + tok * xs, xs, 1, xd[m] + p * xds[m], xds[m]);
        }
    }
    for (int j = 0; j < njobs; j++) b_left[j] = (jobs[j].width + rows_b - 1) / rows_b;

    int nth = threads < MAX_THREADS ? threads : MAX_THREADS;
    if (selected_bytes < PARALLEL_MIN_BYTES || nth < 1) nth = 1;
    int64_t next_b[MAX_THREADS], next_d[MAX_THREADS];
    const int64_t per_b = (items_b + nth - 1) / nth, per_d = (items_d + nth - 1) / nth;
    for (int i = 0; i < nth; i++) next_b[i] = i * per_b, next_d[i] = i * per_d;
    const moe_ctx c = {jobs, item_job, item_row, items_b, rows_b, rows_d, xg, xq, xsc, {xd[GATE], xd[UP]},
                       {xds[GATE], xds[UP]}, g, u, hq, hsc, hd, yd, k, act, alpha, limit, b_left, h_state};

    /* B then D (C inside D), no barrier between: a D item waits only for its own expert's B
     * items. A thread that runs out of items waits (WAIT_UNTIL) until the whole team has, and
     * only then enters the closing barrier: libgomp spins there much longer, burning the time
     * slice a descheduled team mate needs (5x the CPU time of one thread on an oversubscribed
     * machine). */
    int arrived = 0;
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        take_items(&c, item_gate_up, 0, items_b, nth, next_b);
        take_items(&c, item_down, items_b, items_d, nth, next_d);
        const int team = omp_get_num_threads();
        __atomic_add_fetch(&arrived, 1, __ATOMIC_ACQ_REL);
        WAIT_UNTIL(__atomic_load_n(&arrived, __ATOMIC_ACQUIRE) >= team);
    }

    /* E: each token's weighted sum, ascending expert, then the shared expert */
    for (int64_t tok = 0; tok < t; tok++) {
        float *o = out + tok * k;
        for (int64_t s = 0; s < top_k; s++) {
            const int64_t p = tok_pairs[tok * top_k + s];
            const float w = weights[pair_of[p]], *y = yd + p * k;
            const __m256 wv = _mm256_set1_ps(w);
            int64_t j = 0;
            if (s == 0) {
                for (; j + 8 <= k; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(wv, _mm256_loadu_ps(y + j)));
                for (; j < k; j++) o[j] = w * y[j];
            } else {
                for (; j + 8 <= k; j += 8)
                    _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(wv, _mm256_loadu_ps(y + j))));
                for (; j < k; j++) o[j] += w * y[j];
            }
        }
        if (top_k == 0) memset(o, 0, (size_t)k * sizeof(float));
        if (shared) {
            const float w = shared_scale ? shared_scale[tok] : 1.0f, *y = yd + (pairs + tok) * k;
            const __m256 wv = _mm256_set1_ps(w);
            int64_t j = 0;
            for (; j + 8 <= k; j += 8)
                _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(wv, _mm256_loadu_ps(y + j))));
            for (; j < k; j++) o[j] += w * y[j];
        }
    }
    scratch_done(base);
}
