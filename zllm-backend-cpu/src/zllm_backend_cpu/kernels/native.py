"""The native kernel library ``zllm_backend_cpu/_native.so`` (sources ``csrc/*.c``, built by
the distribution's ``setup.py`` at install time): loading it, binding its entry points, and
why it is unavailable.

The library holds the decode-step kernels: GEMV for ``linear`` (``csrc/gemv.c``; the HF
quantized layouts FP8 / INT4 / INT8 / MXFP4 / NVFP4 in ``csrc/quant_gemv.c``), RMSNorm,
fused add + RMSNorm, RoPE and SiLU-and-mul (``csrc/elementwise.c``), paged decode
attention (``csrc/attention.c``), MLA decode over the paged latent cache (``csrc/mla.c``) and
the MoE FFN (``csrc/moe.c``).

It is optional. It is missing where the install had no C compiler or the platform is not
x86-64; it is refused when the CPU lacks AVX2/FMA/F16C or the file is a stale build of
another source version. :func:`unavailable_reason` says which, and the plugin registers the
native kernels only when it is ``None`` (otherwise the torch kernels carry that reason into
``zllm run --explain``).

torch is imported before the library is loaded: the library needs ``libgomp.so.1``, and the
dynamic loader then binds it to the copy torch loaded, so torch's ops and the native kernels
share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: F401  (imported first; see the module doc)

LIBRARY_PATH = Path(__file__).resolve().parent.parent / "_native.so"
ABI_VERSION = 7  # ZLLM_NATIVE_ABI in csrc/library.c: a mismatch means a stale build

#: ctypes argument types: pointers (``tensor.data_ptr()`` or None), 64-bit sizes and strides,
#: C ints and floats.
P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if not LIBRARY_PATH.exists():
        return None, (f"{LIBRARY_PATH.name} was not built at install time (it needs a C compiler and "
                      f"x86-64); reinstall zllm-backend-cpu where gcc is available")
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as e:
        return None, f"cannot load {LIBRARY_PATH}: {e}"
    try:
        lib.zllm_native_abi.restype = ctypes.c_int
        abi = lib.zllm_native_abi()
    except AttributeError:
        abi = None
    if abi != ABI_VERSION:
        return None, (f"{LIBRARY_PATH} is a stale build (ABI {abi}, this source expects {ABI_VERSION}); "
                      f"reinstall zllm-backend-cpu")
    lib.zllm_native_cpu_missing.restype = ctypes.c_char_p
    missing = lib.zllm_native_cpu_missing().decode()
    if missing:
        return None, f"this CPU lacks {missing.upper()}, which the native kernels need (AVX2, FMA, F16C)"
    return lib, None


def library() -> ctypes.CDLL:
    """The loaded library.

    Raises:
        RuntimeError: it is unavailable (the message is :func:`unavailable_reason`).
    """
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {reason}")
    return lib


@functools.cache
def function(name: str, *argtypes: type) -> Callable[..., None]:
    """The library's entry point ``name`` with its ``argtypes`` set (returning void), bound once.

    Raises:
        RuntimeError: the library is unavailable.
        AttributeError: it has no such entry point.
    """
    fn = getattr(library(), name)
    fn.argtypes, fn.restype = list(argtypes), None
    return fn


def unavailable_reason() -> str | None:
    """Why the native library cannot be used on this machine, or ``None`` when it can."""
    return _load()[1]


__all__ = ["ABI_VERSION", "F32", "I64", "INT", "LIBRARY_PATH", "P", "function", "library", "unavailable_reason"]
