"""The CPU backend instance: thread count and tensor placement."""

from __future__ import annotations

import os
import warnings

import torch


class CpuBackend:
    """torch on the host CPU.

    Args:
        threads: intra-op threads for torch; None = the number of cores available to this
            process (``os.sched_getaffinity`` where the OS has it). More than that is
            lowered to it, with a warning.
        device: None or ``"cpu"``: the host CPU is the only device of this backend.

    Raises:
        ValueError: ``device`` names another device.
    """

    name = "cpu"
    device = torch.device("cpu")
    process_group_backend = "gloo"
    """torch.distributed's backend for the collectives of several ranks (``parallel``)."""

    def __init__(self, threads: int | None = None, device: str | None = None):
        if device not in (None, "cpu"):
            raise ValueError(
                f"the cpu backend runs on the host CPU only: device must be 'cpu' or unset, got {device!r}"
            )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if threads is None:
            threads = cores
        elif threads > cores:
            # More threads than cores only adds contention, and thousands of them make the
            # OpenMP runtime fail to start threads or crash the process.
            warnings.warn(f"backend.threads {threads} exceeds the {cores} cores available; using {cores}", stacklevel=2)
            threads = cores
        self.threads = threads
        torch.set_num_threads(threads)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
