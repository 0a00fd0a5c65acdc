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

ISA level: the library is built for AVX2 + FMA + F16C; the GEMV row kernels of the GGUF block
formats and of the HF quantized layouts also have AVX-512 versions (F, BW, VL, DQ, VNNI), which
the library selects when it is loaded where the CPU has them. ``ZLLM_NATIVE_ISA=avx2`` (read
here, once, when the library is loaded) forces the AVX2 kernels; ``auto`` (or unset) takes the
best the CPU has. :func:`isa_description` says which runs and why (the registry note of those
kernels, so ``zllm run --explain`` shows it). The block formats give the same bits at both
levels; the HF layouts sum in another fixed order (``csrc/quant_gemv.c``). At the AVX-512 level
the FP8 rows take BF16 dot products of exact bf16 pieces of x where the CPU also has AVX512_BF16
and AVX512_VBMI (``csrc/quant_gemv_bf16.c``; :func:`select_fp8_bf16` turns them off for
comparisons).

torch is imported before the library is loaded: the library needs ``libgomp.so.1``, and the
dynamic loader then binds it to the copy torch loaded, so torch's ops and the native kernels
share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch  # noqa: F401  (imported first; see the module doc)

LIBRARY_PATH = Path(__file__).resolve().parent.parent / "_native.so"
ABI_VERSION = 10  # ZLLM_NATIVE_ABI in csrc/library.c: a mismatch means a stale build
ISA_SETTING = "ZLLM_NATIVE_ISA"
#: ISA levels of the row kernels, in the order of csrc/isa.h's enum (its index is the C level).
ISA_LEVELS = ("avx2", "avx512")
_AVX512_FEATURES = "AVX-512 F/BW/VL/DQ/VNNI"

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
    highest, error = _isa_setting()
    if highest is None:
        return None, error
    lib.zllm_native_select_isa.argtypes, lib.zllm_native_select_isa.restype = [ctypes.c_int], ctypes.c_int
    lib.zllm_native_isa.restype = ctypes.c_int
    lib.zllm_native_select_isa(ISA_LEVELS.index(highest))
    return lib, None


@functools.cache
def _isa_setting() -> tuple[str | None, str | None]:
    """``ZLLM_NATIVE_ISA`` read once: (the highest level it allows, None) or (None, why it is invalid)."""
    try:
        return requested_isa(os.environ), None
    except ValueError as e:
        return None, str(e)


def requested_isa(environ: Mapping[str, str]) -> str:
    """The highest ISA level ``ZLLM_NATIVE_ISA`` in ``environ`` allows: ``"avx2"`` when it says
    ``avx2``, ``"avx512"`` when it is unset, empty or ``auto`` (the CPU may still lack it).

    Raises:
        ValueError: any other value (the message names it and the valid ones).
    """
    value = environ.get(ISA_SETTING, "").strip().lower()
    if value in ("", "auto"):
        return ISA_LEVELS[-1]
    if value == "avx2":
        return "avx2"
    raise ValueError(f"{ISA_SETTING}={environ[ISA_SETTING]!r} is not one of auto, avx2")


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


def isa() -> str:
    """The ISA level of the row kernels in use: ``"avx2"`` or ``"avx512"``.

    Raises:
        RuntimeError: the library is unavailable.
    """
    return ISA_LEVELS[library().zllm_native_isa()]


def select_isa(highest: str) -> str:
    """Makes the row kernels use the best level up to ``highest`` (one of :data:`ISA_LEVELS`) that
    the CPU runs, and returns the level now in use. For comparing the levels (tests,
    benchmarks); never while kernels run.

    Raises:
        ValueError: ``highest`` is not a level.
        RuntimeError: the library is unavailable.
    """
    if highest not in ISA_LEVELS:
        raise ValueError(f"ISA level {highest!r} is not one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[library().zllm_native_select_isa(ISA_LEVELS.index(highest))]


def select_fp8_bf16(allow: bool) -> bool:
    """Allows or forbids the FP8 rows' BF16 dot-product kernels (``csrc/quant_gemv_bf16.c``; allowed
    when the library loads) and returns whether they are in use now: allowed, at the
    ``"avx512"`` level, on a CPU with AVX512_BF16 and AVX512_VBMI. For comparing them with the
    f32 rows (tests, benchmarks); never while kernels run.

    Raises:
        RuntimeError: the library is unavailable.
    """
    fn = library().zllm_native_fp8_bf16
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return bool(fn(int(allow)))


def isa_description() -> str:
    """The row kernels' ISA level in use and why, for ``zllm run --explain``.

    Raises:
        RuntimeError: the library is unavailable.
    """
    level = isa()
    if level == "avx512":
        return f"native row kernels: {_AVX512_FEATURES}"
    if _isa_setting()[0] == "avx2":
        return f"native row kernels: AVX2 ({ISA_SETTING}=avx2)"
    return f"native row kernels: AVX2 (this CPU lacks {_AVX512_FEATURES})"


def unavailable_reason() -> str | None:
    """Why the native library cannot be used on this machine, or ``None`` when it can."""
    return _load()[1]


__all__ = ["ABI_VERSION", "F32", "I64", "INT", "ISA_LEVELS", "ISA_SETTING", "LIBRARY_PATH", "P", "function", "isa",
           "isa_description", "library", "requested_isa", "select_fp8_bf16", "select_isa",
           "unavailable_reason"]
