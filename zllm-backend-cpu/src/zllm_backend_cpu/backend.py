"""The CPU backend instance: thread count and tensor placement."""

from __future__ import annotations

import os

import torch


class CpuBackend:
    """torch on the host CPU.

    Args:
        threads: intra-op threads for torch; None = the number of cores available to this
            process (``os.sched_getaffinity`` where the OS has it).
    """

    name = "cpu"
    device = torch.device("cpu")

    def __init__(self, threads: int | None = None):
        if threads is None:
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.threads = threads
        torch.set_num_threads(threads)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
