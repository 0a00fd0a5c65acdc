"""Build step of zllm-backend-cpu: compiles the native kernel library (``csrc/*.c``: GEMV,
element-wise ops, paged decode attention, MLA decode) with the machine's C compiler into
``zllm_backend_cpu/_native.so``; the metadata is in pyproject.toml.

The library is a plain shared object loaded with ctypes (never imported as a Python module),
so its file name carries no Python ABI tag and the wheel is tagged ``py3-none-<platform>``.
It is optional: where it cannot be built (no C compiler, not x86-64), the install goes on
and the backend uses its torch kernels, saying why in ``zllm run --explain``.
"""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext


class BuildSharedLibrary(build_ext):
    """``build_ext`` naming the library ``<package path>/<name>.so``."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"


class PlatformWheel(bdist_wheel):
    """A wheel tied to the platform (native code) but to no Python version or ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


NATIVE = Extension(
    "zllm_backend_cpu._native",
    sources=sorted(str(p.relative_to(Path(__file__).parent)) for p in (Path(__file__).parent / "csrc").glob("*.c")),
    depends=["csrc/common.h", "csrc/gemv.h", "csrc/isa.h", "csrc/paged.h", "csrc/quant_gemv.h",
             "csrc/quant_digits.h", "csrc/quant_gemv_bf16.h"],
    # The ISA flags name exactly what the intrinsics need (checked at load time; the AVX-512
    # row kernels carry their own target attribute and are chosen at load, csrc/isa.h); -mtune
    # schedules for the machine that builds (and runs) it. No -ffast-math and no
    # contraction: the reduction order is part of the kernels' contract (see gemv.c, attention.c).
    extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-mtune=native", "-fopenmp",
                        "-ffp-contract=off", "-g0", "-std=c11"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(ext_modules=[NATIVE], cmdclass={"build_ext": BuildSharedLibrary, "bdist_wheel": PlatformWheel})
