/* The ISA levels of the native row kernels, selected once when the library is loaded
 * (library.c): every file is built for AVX2 + FMA + F16C (common.h); the GEMV row kernels of
 * the GGUF block formats (gemv_avx512.c) and of the HF layouts (quant_gemv.c) also have
 * AVX-512 versions, compiled per function with the AVX512 attribute below and called only
 * where the CPU has all of ISA_AVX512_FLAGS. At the AVX-512 level the FP8 rows of the HF layouts
 * take BF16 dot products (quant_gemv_bf16.c) where the CPU also has ISA_AVX512_BF16_FLAGS'
 * additions (native_fp8_bf16), and INT8 rows with K and the groups multiples of 64 take VNNI dot
 * products against x as exact int8 digits (quant_gemv_vnni.c). At the AVX2 level INT4 rows with K
 * and the groups multiples of 64 take vpmaddubsw dot products against the same digits
 * (quant_gemv_int4.c). */
#ifndef ZLLM_NATIVE_ISA_H
#define ZLLM_NATIVE_ISA_H

enum { ISA_AVX2 = 0, ISA_AVX512 = 1 };

#define ISA_AVX512_FLAGS "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define AVX512 __attribute__((target(ISA_AVX512_FLAGS)))
#define ISA_AVX512_BF16_FLAGS ISA_AVX512_FLAGS ",avx512bf16,avx512vbmi"
#define AVX512_BF16 __attribute__((target(ISA_AVX512_BF16_FLAGS)))

/* The level in use (library.c); read by the dispatch, written only at load and by
 * zllm_native_select_isa. */
extern int native_isa_level __attribute__((visibility("hidden")));
/* Whether the FP8 rows take quant_gemv_bf16.c's kernels: the AVX-512 level is in use, the CPU
 * has ISA_AVX512_BF16_FLAGS and zllm_native_fp8_bf16 has not turned them off (library.c). */
extern int native_fp8_bf16 __attribute__((visibility("hidden")));

#endif
