/* The row kernels of gemv.c (and of kquant_gemv.c, the GGUF k-quants), for the other native
 * kernels that multiply by weights in their stored formats (moe.c): one call's operands, the
 * per-format function computing a range of output rows for every token, and the int16
 * quantization of activations that the block formats take. Numerics and reduction orders are
 * gemv.c's (its file comment). */
#ifndef ZLLM_NATIVE_GEMV_H
#define ZLLM_NATIVE_GEMV_H

#include <stdint.h>

/* One call's operands: w [N, K] with row stride ws (elements; bytes for the block formats),
 * x [T, K] with row stride xs, y [T, N] contiguous (row stride n); xq / xsc: x quantized per
 * block of 32 (T x K int16, T x K / 32 scales), block formats only, else NULL. */
typedef struct {
    const void *w;
    int64_t ws;
    const float *x;
    int64_t xs;
    int16_t *xq;
    float *xsc;
    const float *bias;
    float *y;
    int64_t t, n, k;
} gemv_args;

/* y[:, r0:r1) of a call: rows r0 .. r1 - 1 for all T tokens. */
typedef void (*rows_fn)(const gemv_args *a, int64_t r0, int64_t r1);

/* Weight formats, in the order of zllm_backend_cpu.kernels.GEMV_FORMATS. */
enum { GEMV_F32, GEMV_F16, GEMV_BF16, GEMV_Q8_0, GEMV_Q4_0, GEMV_Q4_1, GEMV_Q5_0, GEMV_Q5_1,
       GEMV_Q2_K, GEMV_Q3_K, GEMV_Q4_K, GEMV_Q5_K, GEMV_Q6_K, GEMV_NFORMATS };

#define GEMV_INTERNAL __attribute__((visibility("hidden")))

/* The row loop of a block format's row kernel FN (gemv.c, gemv_avx512.c): per row, the tokens
 * in groups of 4 through DOT (one conversion of a weight block for 4 tokens), then the last
 * 1-3 together; DOT's last argument is a literal so each count gets its own unrolled body.
 * ATTR: the ISA level's target attribute, or nothing. */
#define GEMV_QUANT_ROWS(FN, DOT, ATTR)                                                          \
ATTR static void FN(const gemv_args *a, int64_t r0, int64_t r1) {                               \
    const int64_t n = a->n, k = a->k;                                                           \
    for (int64_t r = r0; r < r1; r++) {                                                         \
        const uint8_t *wr = (const uint8_t *)a->w + r * a->ws;                                  \
        const float *br = a->bias ? a->bias + r : 0;                                            \
        int64_t t = 0;                                                                          \
        for (; t + 4 <= a->t; t += 4)                                                           \
            DOT(wr, a->xq + t * k, a->xsc + t * (k / 32), k, br, a->y + t * n + r, n, 4);       \
        const int64_t left = a->t - t;                                                          \
        const int16_t *xq = a->xq + t * k;                                                      \
        const float *xs = a->xsc + t * (k / 32);                                                \
        float *y = a->y + t * n + r;                                                            \
        if (left == 1) DOT(wr, xq, xs, k, br, y, n, 1);                                         \
        else if (left == 2) DOT(wr, xq, xs, k, br, y, n, 2);                                    \
        else if (left == 3) DOT(wr, xq, xs, k, br, y, n, 3);                                    \
    }                                                                                           \
}

/* The row kernel of `format` at the ISA level in use (isa.h), or NULL for a number outside
 * the enum. */
GEMV_INTERNAL rows_fn gemv_rows(int format);
/* The AVX-512 row kernel of `format` (gemv_avx512.c), or NULL where it has none. */
GEMV_INTERNAL rows_fn gemv_rows_avx512(int format);
/* Whether `format` is a block format (takes quantized x). */
GEMV_INTERNAL int gemv_is_block(int format);
/* x [T, K] (row stride xs, K a multiple of 32) -> xq [T, K] int16 and xsc [T, K / 32]. */
GEMV_INTERNAL void gemv_quantize_rows(const float *x, int64_t xs, int64_t t, int64_t k, int16_t *xq, float *xsc);
/* Bytes of one row of K weights in `format` (K a multiple of the format's block). */
GEMV_INTERNAL int64_t gemv_row_bytes(int format, int64_t k);
/* A block-format entry point's body: quantizes x [T, K] (row stride xs) and runs rows over the
 * N rows of w (row stride ws bytes, row_bytes each) with gemv.c's thread split -> y [T, N]; y is
 * NaN when the quantized x cannot be allocated. */
GEMV_INTERNAL void gemv_quantized(const void *w, int64_t ws, const float *x, int64_t xs, const float *bias, float *y,
                                  int64_t t, int64_t n, int64_t k, int64_t row_bytes, int threads, rows_fn rows);

/* The k-quant row kernels (kquant_gemv.c). */
GEMV_INTERNAL void gemv_rows_q2_k(const gemv_args *a, int64_t r0, int64_t r1);
GEMV_INTERNAL void gemv_rows_q3_k(const gemv_args *a, int64_t r0, int64_t r1);
GEMV_INTERNAL void gemv_rows_q4_k(const gemv_args *a, int64_t r0, int64_t r1);
GEMV_INTERNAL void gemv_rows_q5_k(const gemv_args *a, int64_t r0, int64_t r1);
GEMV_INTERNAL void gemv_rows_q6_k(const gemv_args *a, int64_t r0, int64_t r1);

#endif
