/* The GEMV of the HF quantized kernel layouts (quant_gemv.c) for the other native kernels that
 * multiply by such weights in their stored formats (moe.c): one weight's operands, and the
 * dispatch that picks the row kernel of a weight (and the preparation of x it takes) at the
 * ISA level in use. Numerics and reduction orders are quant_gemv.c's (its file comment): each
 * output row in an order that depends only on the layout, K, the group size and the ISA
 * level, so a caller that prepares each token's x from that token's row alone keeps the rows
 * batch-invariant. */
#ifndef ZLLM_NATIVE_QUANT_GEMV_H
#define ZLLM_NATIVE_QUANT_GEMV_H

#include <stdint.h>

/* The layouts, in quant_gemv.c's order (not zllm_backend_cpu.kernels.QUANT_GEMV_FORMATS'). */
enum { L_INT4, L_INT8, L_MXFP4, L_NVFP4, L_FP8 };

/* One weight [N, K] (file comment of quant_gemv.c for each layout's parts); fields a layout
 * does not use are 0. */
typedef struct {
    const uint8_t *q;      /* quants, row stride row_bytes */
    const void *scales;    /* f32 (fp8, int) or uint8 (mxfp4, nvfp4) */
    const uint8_t *zeros;  /* int4_g / int8_g */
    float global;          /* nvfp4 */
    int64_t n, k, g;       /* g: columns per scale group (fp8: bk) */
    int64_t bn;            /* fp8: rows per scale block */
    int64_t row_bytes;
    int64_t ng;            /* scale groups per row, ceil(k / g): once per call, not per row */
} qweight;

/* y[t, r] (row stride w->n) = row r of w times token t of x [T, K] (row stride xs) (+ bias[r]),
 * for rows [r0, r1) and all T tokens. */
typedef void (*qrows_fn)(const qweight *w, int64_t r0, int64_t r1, const float *x, int64_t xs, const float *bias,
                         float *y, int64_t t);
/* x [T, K] (row stride xs) prepared for a row kernel into xd [T, xds]; each token's row from
 * that token's row of x alone. */
typedef void (*qprep_fn)(const qweight *w, const float *x, int64_t xs, int64_t t, float *xd, int64_t xds);

/* How the GEMV runs a weight: rows against x prepared by prep into rows of xds floats, or
 * (prep NULL, xds 0) against x itself. */
typedef struct {
    qrows_fn rows;
    qprep_fn prep;
    int64_t xds;
} qgemv_plan;

/* The plan of weight w of `layout` (its shape and group size decide it) at the ISA level in
 * use; fills the decode tables on first use. FP8, INT8 and INT4 plan the f32 rows: the BF16 rows
 * of quant_gemv_bf16.c, the VNNI rows of quant_gemv_vnni.c and the AVX2 INT4 rows of
 * quant_gemv_int4.c are whole GEMVs (x split per call), taken by zllm_qgemv_fp8 /
 * zllm_qgemv_int8 / zllm_qgemv_int4 alone. */
__attribute__((visibility("hidden"))) qgemv_plan qgemv_plan_of(const qweight *w, int layout);

#endif
