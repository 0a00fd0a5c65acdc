/* f32 activations as exact int8 digits for the integer dot-product GEMVs of the HF layouts
 * (quant_digits.c): INT8 rows through AVX512-VNNI (quant_gemv_vnni.c) and INT4 rows through
 * AVX2 vpmaddubsw (quant_gemv_int4.c). Each token's x is split once per call; numerics in
 * quant_digits.c's file comment. */
#ifndef ZLLM_NATIVE_QUANT_DIGITS_H
#define ZLLM_NATIVE_QUANT_DIGITS_H

#include <stdint.h>

#define DIGITS_BLOCK 256 /* columns per digit scale d (at most: a group's last block may be shorter) */
#define DIGITS_N 4
#define DIGITS_CHUNK_BYTES (64 << 10) /* weight bytes per work item, as quant_gemv.c */
#define DIGITS_MIN_E (-126 + 7 * (DIGITS_N - 1)) /* the smallest E whose last digit weight is normal */

/* Where the digits of a 64-column step go, for the quants' order in a 64-byte (INT8) or 32-byte
 * (INT4) load: DIGITS_COLUMNS column c + j at byte j; DIGITS_NIBBLES the 32 even columns, then
 * the 32 odd ones (column c + 2j at byte j, c + 2j + 1 at byte 32 + j: byte j of 32 INT4 bytes
 * holds columns 2j (low nibble) and 2j + 1 (high)). */
enum { DIGITS_COLUMNS, DIGITS_NIBBLES };

/* One token's x as digits, at bytes [0, stride) of its buffer: per 64 columns c (a multiple of
 * 64), bytes [4c + 64 i, 4c + 64 i + 64) hold digit i of the step's columns in `order`; then per
 * block the weights of its two digit pairs, d 2^-7 and d 2^-21 (f32, at w_at); then at sums_at
 * (f32) per group its sum of x (DIGITS_COLUMNS), or per block 8 lane sums, lane j the sum over
 * the block's 64-column steps of x's columns 8j .. 8j + 7 of the step (DIGITS_NIBBLES: the
 * columns of int32 lane j after vpmaddubsw and vpmaddwd of a step). stride: bytes per token, a
 * multiple of 64. Blocks run group by group, each group cut into blocks of DIGITS_BLOCK columns
 * from its start (the last one shorter). */
typedef struct {
    int64_t k, g, ng, nb; /* g: columns per group (K for one scale per row); nb: blocks per token (at most) */
    int64_t w_at, sums_at, stride;
    int order;
} digits_layout;

/* The layout of K columns in groups of g (g >= K: one group), K and g multiples of 64 (or g >= K). */
digits_layout digits_layout_of(int64_t k, int64_t g, int order) __attribute__((visibility("hidden")));

/* Token x [K] -> its digits, digit weights and sums at out (digits_layout); 0 where x holds a
 * non-finite value or a block's max |x| is nonzero and under 2^-99 = 2^(DIGITS_MIN_E + 6) (the
 * caller takes that token through its f32 kernels), else 1. */
int digits_split_token(const digits_layout *L, const float *x, uint8_t *out) __attribute__((visibility("hidden")));

/* Rows [r0, r1) of a digit kernel times the T tokens' digits dg (stride L->stride) -> y [T, N]. */
typedef void (*digit_rows_fn)(const digits_layout *L, const uint8_t *q, const float *scales, const uint8_t *zeros,
                              const uint8_t *dg, const float *bias, float *y, int64_t n, int64_t t, int64_t r0,
                              int64_t r1);

/* A digit kernel's GEMV (the caller has checked the ISA level and the shape): splits the leading
 * tokens whose x the digits hold (digits_layout_of(k, g, order)), runs `rows` over work items of
 * about DIGITS_CHUNK_BYTES of weights (row_bytes a row) handed out dynamically, and returns their
 * count (0: the first token's x cannot be held); -1 where the digits cannot be allocated (nothing
 * written). */
int64_t digits_gemv(digit_rows_fn rows, int order, int64_t row_bytes, const uint8_t *q, const float *scales,
                    const uint8_t *zeros, int64_t g, const float *x, int64_t xs, const float *bias, float *y, int64_t t,
                    int64_t n, int64_t k, int threads) __attribute__((visibility("hidden")));

/* The digit kernels' entries, called from quant_gemv.c's zllm_qgemv_int8 (int8_vnni_gemv:
 * quant_gemv_vnni.c, AVX512-VNNI) and zllm_qgemv_int4 (int4_digits_gemv: quant_gemv_int4.c, AVX2
 * vpmaddubsw), with their arguments -> y for the leading tokens whose x the digits hold, returning
 * their count (0 where the first token's x cannot be held: the caller takes that token alone, then
 * calls again with the rest); -1 where the ISA level or the shape rule these rows out, or the
 * digits cannot be allocated (nothing written). */
int64_t int8_vnni_gemv(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g, const float *x,
                       int64_t xs, const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads)
    __attribute__((visibility("hidden")));
int64_t int4_digits_gemv(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g, const float *x,
                         int64_t xs, const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads)
    __attribute__((visibility("hidden")));

#endif
