/* Identity, CPU check and ISA level of the native kernel library (libzllm native, loaded by
 * zllm_backend_cpu.kernels.native with ctypes). */
#include <stdint.h>

#include "isa.h"

/* Bumped whenever an entry point of any csrc/ file changes: a build of another source
 * version is then refused as stale instead of called with the wrong arguments. */
#define ZLLM_NATIVE_ABI 10

int zllm_native_abi(void) { return ZLLM_NATIVE_ABI; }

/* The first CPU feature the library needs that the running CPU lacks, or "" when none is
 * missing. Compiled for baseline x86-64 so that it runs on any x86-64 CPU. */
__attribute__((target("arch=x86-64"))) const char *zllm_native_cpu_missing(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return "avx2";
    if (!__builtin_cpu_supports("fma")) return "fma";
    if (!__builtin_cpu_supports("f16c")) return "f16c";
    return "";
}

/* Whether the CPU has every feature of ISA_AVX512_FLAGS (isa.h). */
__attribute__((target("arch=x86-64"))) static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Whether the CPU has ISA_AVX512_BF16_FLAGS' additions to ISA_AVX512_FLAGS (isa.h). */
__attribute__((target("arch=x86-64"))) static int cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}

int native_isa_level = ISA_AVX2;
int native_fp8_bf16 = 0;
static int fp8_bf16_allowed = 1;

/* native_fp8_bf16 for the level in use. */
static void select_fp8_bf16(void) {
    native_fp8_bf16 = fp8_bf16_allowed && native_isa_level >= ISA_AVX512 && cpu_has_avx512_bf16();
}

/* The best level the CPU has, chosen when the library is loaded (before any kernel runs). */
__attribute__((target("arch=x86-64"), constructor)) static void select_isa_at_load(void) {
    native_isa_level = cpu_has_avx512() ? ISA_AVX512 : ISA_AVX2;
    select_fp8_bf16();
}

/* Selects the row kernels of at most level `highest` (ISA_AVX2 = 0, ISA_AVX512 = 1) that the
 * CPU runs, and returns the level now in use. For the loader (the ZLLM_NATIVE_ISA setting)
 * and for tests comparing the levels; never call it while kernels run. */
int zllm_native_select_isa(int highest) {
    native_isa_level = highest >= ISA_AVX512 && cpu_has_avx512() ? ISA_AVX512 : ISA_AVX2;
    select_fp8_bf16();
    return native_isa_level;
}

/* Allows (allow != 0) or forbids the FP8 rows' BF16 kernels (quant_gemv_bf16.c; allowed when the
 * library loads) and returns whether they are in use now: allowed, at the AVX-512 level, on a
 * CPU with avx512_bf16 and avx512_vbmi. For tests and benchmarks comparing them with the f32
 * rows; never call it while kernels run. */
int zllm_native_fp8_bf16(int allow) {
    fp8_bf16_allowed = allow != 0;
    select_fp8_bf16();
    return native_fp8_bf16;
}

/* The level the row kernels use now. */
int zllm_native_isa(void) { return native_isa_level; }
