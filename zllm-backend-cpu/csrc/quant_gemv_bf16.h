/* FP8 E4M3 GEMV rows through AVX-512 BF16 dot products (quant_gemv_bf16.c), called from
 * quant_gemv.c's zllm_qgemv_fp8. */
#ifndef ZLLM_NATIVE_QUANT_GEMV_BF16_H
#define ZLLM_NATIVE_QUANT_GEMV_BF16_H

#include <stdint.h>

/* fp8_bf16_gemv's outcome: y written; the shape or the CPU does not take these rows (nothing
 * written); some token's x is out of their range (nothing written: take each token alone). */
enum { FP8_BF16_DONE, FP8_BF16_UNFIT, FP8_BF16_OUT_OF_RANGE };

/* zllm_qgemv_fp8's arguments (quant_gemv.c); one of the outcomes above. */
int fp8_bf16_gemv(const uint8_t *q, const float *scale, int64_t bn, int64_t bk, const float *x, int64_t xs,
                  const float *bias, float *y, int64_t t, int64_t n, int64_t k, int threads)
    __attribute__((visibility("hidden")));

#endif
