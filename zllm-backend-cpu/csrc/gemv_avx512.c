/* AVX-512 row kernels of the GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), bit-identical
 * to gemv.c's AVX2 kernels (its file comment: layouts, int16 activations, numerics, order):
 * chosen by gemv_rows (gemv.c) where the CPU has ISA_AVX512_FLAGS (isa.h).
 *
 * Per 32-weight block the AVX2 kernel forms 8 exact int32 lanes, lane i = the products 2i,
 * 2i + 1 (two _mm256_madd_epi16 over weights 0..15 and 16..31) plus 16 + 2i, 17 + 2i (their
 * _mm256_add_epi32). Here two vpdpwssd (AVX512-VNNI, 256-bit with AVX512-VL: each int32 lane
 * += the two int16 products of its lane pair) form the same lanes: the first into zeros, the
 * second on top. The sums are exact integers (|lane| <= 4 * 128 * 32767 < 2^24), so the order
 * of the additions cannot change them, and everything after is the AVX2 kernel's f32
 * operations in its order: the lanes converted, one FMA with d_b * s_b (an f32 product, as
 * the AVX2 kernel's scalar one: here d broadcast as f16 and converted, then times the
 * broadcast s) into the even / odd block accumulator, the m_b * s_b FMA for Q4_1 / Q5_1 (the
 * block's sums of q_x again by two vpdpwssd, with ones), a0 + a1 and gemv.c's horizontal sum.
 * Q5_0 / Q5_1 take bit 4 of each weight from qh as an AVX512-BW mask (a masked add / subtract
 * of 16) instead of AVX2's broadcast, compare and mask.
 *
 * Why 256-bit vectors: this machine's Zen 4 cores run a 512-bit operation as two 256-bit
 * halves, and the loop is bound by vector operations (about 9 a block). Two blocks in one
 * 512-bit vector (lanes 0-7 even block, 8-15 odd block: the AVX2 kernel's two accumulators in
 * one register) needed cross-lane inserts of the weights and activations and a built pair of
 * scales, and measured 10-20% slower than AVX2; these kernels save the madd + add pairs and
 * the Q5 bit expansion (measured in docs/performance.md).
 */
#include "common.h"
#include "gemv.h"
#include "isa.h"

#include <string.h>

/* Tokens sharing one decode of a weight block (gemv.c: 2). Four keep their 8 accumulators, the
 * weights and the scales within the 32 vector registers that AVX-512 VL gives 256-bit code;
 * a MoE decode step of 16 tokens gives each selected expert 2-4 of them (moe.c). */
#define TOKENS_MAX 4
#define QUANT_PREFETCH_BYTES 2048 /* as gemv.c */

#define PREFETCH(p, ahead, bytes)                                                              \
    for (int pf_ = 0; pf_ < (int)(bytes); pf_ += 64)                                           \
        _mm_prefetch((const char *)(p) + (ahead) + pf_, _MM_HINT_T0)

/* A block's 32 quantized weights as two 16-lane int16 vectors, in order: gemv.c's
 * block_<format> (static there; Q5_0 / Q5_1 differ below). */
INLINE void block_q8_0(const uint8_t *b, __m256i q[2]) {
    q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
    q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
}
INLINE void nibbles16(const uint8_t *p, __m256i q[2]) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    q[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(v, 4);
}
INLINE void block_q4_0(const uint8_t *b, __m256i q[2]) {
    nibbles16(b + 2, q);
    q[0] = _mm256_sub_epi16(q[0], _mm256_set1_epi16(8));
    q[1] = _mm256_sub_epi16(q[1], _mm256_set1_epi16(8));
}
INLINE void block_q4_1(const uint8_t *b, __m256i q[2]) { nibbles16(b + 4, q); }

/* Q5_0 / Q5_1 (p: the qh word): the nibbles after qh, plus 16 where bit i of qh is set
 * (`bias`: minus 16 everywhere, Q5_0); 16 bits of qh are the mask of 16 lanes. */
INLINE AVX512 void quants5(const uint8_t *p, int bias, __m256i q[2]) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    nibbles16(p + 4, q);
    const __mmask16 k0 = (__mmask16)qh, k1 = (__mmask16)(qh >> 16);
    const __m256i sixteen = _mm256_set1_epi16(16);
    if (bias) { /* q - 16 where the bit is clear, q where set */
        q[0] = _mm256_mask_sub_epi16(q[0], (__mmask16)~k0, q[0], sixteen);
        q[1] = _mm256_mask_sub_epi16(q[1], (__mmask16)~k1, q[1], sixteen);
    } else {
        q[0] = _mm256_mask_add_epi16(q[0], k0, q[0], sixteen);
        q[1] = _mm256_mask_add_epi16(q[1], k1, q[1], sixteen);
    }
}
INLINE AVX512 void block_q5_0(const uint8_t *b, __m256i q[2]) { quants5(b + 2, 1, q); }
INLINE AVX512 void block_q5_1(const uint8_t *b, __m256i q[2]) { quants5(b + 4, 0, q); }

/* The f16 at p in all 8 lanes as f32. */
INLINE __m256 f16x8(const uint8_t *p) {
    int16_t h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
}

/* The exact int32 lanes of gemv.c's two madds plus their add: lane i = the products 2i, 2i + 1
 * of q[0] x[0..15] plus those of q[1] x[16..31], by two vpdpwssd. */
INLINE AVX512 __m256i dot_lanes(const __m256i q[2], const int16_t *x) {
    const __m256i *xb = (const __m256i *)x;
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), q[0], _mm256_loadu_si256(xb)), q[1],
                               _mm256_loadu_si256(xb + 1));
}

/* One weight row times TT tokens of quantized x -> y[t * ldy]: gemv.c's dot_<format>, its
 * f32 operations in the same order. */
#define QUANT_DOT512(NAME, BLOCK_BYTES, HAS_MIN)                                               \
INLINE AVX512 void dot512_##NAME(const uint8_t *w, const int16_t *xq, const float *xs, int64_t k, \
                                 const float *bias, float *y, int64_t ldy, const int TT) {      \
    __m256 a[TOKENS_MAX][2];                                                                    \
    for (int t = 0; t < TT; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();                       \
    const int64_t nb = k / 32;                                                                  \
    for (int64_t b = 0; b < nb; b += 2)                                                         \
        for (int h = 0; h < 2; h++) { /* even block -> a[t][0], odd -> a[t][1] */              \
            if (b + h >= nb) break;                                                             \
            const uint8_t *blk = w + (b + h) * (BLOCK_BYTES);                                   \
            PREFETCH(blk, QUANT_PREFETCH_BYTES, BLOCK_BYTES);                                   \
            __m256i q[2];                                                                       \
            block_##NAME(blk, q);                                                               \
            const __m256 d = f16x8(blk), m = (HAS_MIN) ? f16x8(blk + 2) : d;                    \
            for (int t = 0; t < TT; t++) {                                                      \
                const int16_t *xb = xq + t * k + (b + h) * 32;                                  \
                const __m256 s = _mm256_set1_ps(xs[t * nb + b + h]);                            \
                a[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(q, xb)), _mm256_mul_ps(d, s), a[t][h]); \
                if (HAS_MIN) {                                                                  \
                    const __m256i one = _mm256_set1_epi16(1);                                   \
                    const __m256i ones[2] = {one, one};                                         \
                    a[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(ones, xb)), _mm256_mul_ps(m, s), a[t][h]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    for (int t = 0; t < TT; t++) {                                                              \
        const float s = hsum(_mm256_add_ps(a[t][0], a[t][1]));                                  \
        y[t * ldy] = bias ? s + *bias : s;                                                      \
    }                                                                                           \
}

/* Rows [r0, r1) for all T tokens: groups of TOKENS_MAX, then the last 1-3 together. */
#define QUANT_ROWS512(NAME, BLOCK_BYTES, HAS_MIN)                                              \
QUANT_DOT512(NAME, BLOCK_BYTES, HAS_MIN)                                                       \
GEMV_QUANT_ROWS(rows512_##NAME, dot512_##NAME, AVX512)

QUANT_ROWS512(q8_0, 34, 0)
QUANT_ROWS512(q4_0, 18, 0)
QUANT_ROWS512(q4_1, 20, 1)
QUANT_ROWS512(q5_0, 22, 0)
QUANT_ROWS512(q5_1, 24, 1)

rows_fn gemv_rows_avx512(int format) {
    switch (format) {
    case GEMV_Q8_0: return rows512_q8_0;
    case GEMV_Q4_0: return rows512_q4_0;
    case GEMV_Q4_1: return rows512_q4_1;
    case GEMV_Q5_0: return rows512_q5_0;
    case GEMV_Q5_1: return rows512_q5_1;
    default: return 0;
    }
}
