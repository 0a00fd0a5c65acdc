"""Test helper shared by the linear-kernel tests: force small, ragged row tiles."""

from __future__ import annotations

import contextlib

from zllm_backend_cpu.kernels import linear as kernels


@contextlib.contextmanager
def tile_budget(nbytes: int | None):
    """Shrink the kernels' tile budget so that small weights span several (ragged) tiles."""
    saved = kernels.TILE_BYTES
    if nbytes is not None:
        kernels.TILE_BYTES = nbytes
    try:
        yield
    finally:
        kernels.TILE_BYTES = saved
