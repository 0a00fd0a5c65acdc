"""Run every kernel in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here,
before any test module imports a kernel module of ``zllm_kernels_triton``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
