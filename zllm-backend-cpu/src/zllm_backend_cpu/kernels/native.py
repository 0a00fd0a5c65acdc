"""The native GEMV library ``zllm_backend_cpu/_gemv.so`` (source ``csrc/gemv.c``, built by the
distribution's ``setup.py`` at install time): loading it, and why it is unavailable.

The library is optional. It is missing where the install had no C compiler or the platform
is not x86-64; it is refused when the CPU lacks AVX2/FMA/F16C or the file is a stale build of
another source version. :func:`unavailable_reason` says which, and the plugin registers the
native kernels only when it is ``None`` (otherwise the torch kernels carry that reason into
``zllm run --explain``).

torch is imported before the library is loaded: the library needs ``libgomp.so.1``, and the
dynamic loader then binds it to the copy torch loaded, so torch's ops and the GEMV kernels
share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # noqa: F401  (imported first; see the module doc)

LIBRARY_PATH = Path(__file__).resolve().parent.parent / "_gemv.so"
ABI_VERSION = 1  # ZLLM_GEMV_ABI in csrc/gemv.c: a mismatch means a stale build
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0")  # one entry point zllm_gemv_<format> each

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# zllm_gemv_<format>(w, w_row_stride, x, x_row_stride, bias | NULL, y, T, N, K, threads)
_GEMV_ARGTYPES = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_int]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if not LIBRARY_PATH.exists():
        return None, (f"{LIBRARY_PATH.name} was not built at install time (it needs a C compiler and "
                      f"x86-64); reinstall zllm-backend-cpu where gcc is available")
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as e:
        return None, f"cannot load {LIBRARY_PATH}: {e}"
    lib.zllm_gemv_abi.restype = ctypes.c_int
    lib.zllm_gemv_cpu_missing.restype = ctypes.c_char_p
    if lib.zllm_gemv_abi() != ABI_VERSION:
        return None, (f"{LIBRARY_PATH} is a stale build (ABI {lib.zllm_gemv_abi()}, this source expects "
                      f"{ABI_VERSION}); reinstall zllm-backend-cpu")
    missing = lib.zllm_gemv_cpu_missing().decode()
    if missing:
        return None, f"this CPU lacks {missing.upper()}, which the native GEMV kernels need (AVX2, FMA, F16C)"
    for fmt in FORMATS:
        fn = getattr(lib, f"zllm_gemv_{fmt}")
        fn.argtypes, fn.restype = _GEMV_ARGTYPES, None
    return lib, None


def library() -> ctypes.CDLL:
    """The loaded library.

    Raises:
        RuntimeError: it is unavailable (the message is :func:`unavailable_reason`).
    """
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"native GEMV kernels unavailable: {reason}")
    return lib


def unavailable_reason() -> str | None:
    """Why the native library cannot be used on this machine, or ``None`` when it can."""
    return _load()[1]


__all__ = ["ABI_VERSION", "FORMATS", "LIBRARY_PATH", "library", "unavailable_reason"]
