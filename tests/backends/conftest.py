"""The GPU backends' tests run without a GPU: Triton kernels in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` kernel is defined, so it is set here,
at collection, before any test imports a kernel module.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
