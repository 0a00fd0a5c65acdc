/* The ISA levels of the native row kernels, selected once when the library is loaded
 * (library.c): every file is built for AVX2 + FMA + F16C (common.h); the GEMV row kernels of
 * the GGUF block formats (gemv_avx512.c) and of the HF layouts (quant_gemv.c) also have
 * AVX-512 versions, compiled per function with the AVX512 attribute below and called only
 * where the CPU has all of ISA_AVX512_FLAGS. */
#ifndef ZLLM_NATIVE_ISA_H
#define ZLLM_NATIVE_ISA_H

enum { ISA_AVX2 = 0, ISA_AVX512 = 1 };

#define ISA_AVX512_FLAGS "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
#define AVX512 __attribute__((target(ISA_AVX512_FLAGS)))

/* The level in use (library.c); read by the dispatch, written only at load and by
 * zllm_native_select_isa. */
extern int native_isa_level __attribute__((visibility("hidden")));

#endif
