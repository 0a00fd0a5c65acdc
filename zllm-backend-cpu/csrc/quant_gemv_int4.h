/* INT4 GEMV rows at the AVX2 level through vpmaddubsw with x as exact int8 digits
 * (quant_gemv_int4.c), called from quant_gemv.c's zllm_qgemv_int4. */
#ifndef ZLLM_NATIVE_QUANT_GEMV_INT4_H
#define ZLLM_NATIVE_QUANT_GEMV_INT4_H

#include <stdint.h>

/* zllm_qgemv_int4's arguments (quant_gemv.c) -> y for the leading tokens whose x the digits
 * hold, returning their count (0 where the first token's x cannot be held: the caller takes that
 * token alone, then calls again with the rest); -1 where the ISA level or the shape rule these
 * rows out, or the digits cannot be allocated (nothing written). */
int64_t int4_digits_gemv(const uint8_t *q, const float *scales, const uint8_t *zeros, int64_t g, const float *x,
                         int64_t xs, const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads)
    __attribute__((visibility("hidden")));

#endif
