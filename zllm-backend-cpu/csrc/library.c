/* Identity and CPU check of the native kernel library (libzllm native, loaded by
 * zllm_backend_cpu.kernels.native with ctypes). */
#include <stdint.h>

/* Bumped whenever an entry point of any csrc/ file changes: a build of another source
 * version is then refused as stale instead of called with the wrong arguments. */
#define ZLLM_NATIVE_ABI 7

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
