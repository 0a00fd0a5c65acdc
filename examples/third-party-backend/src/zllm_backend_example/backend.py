"""The backend instance: where tensors live. Constructed as ``ExampleBackend(threads=...)``
(plus ``device=...`` when the user names one, e.g. ``zllm conformance --device``) only after
:meth:`unavailable_reason` said it can run."""

from __future__ import annotations

import torch


class ExampleBackend:
    name = "example"
    device = torch.device("cpu")

    def __init__(self, threads: int | None = None, device: str | None = None):
        # A GPU backend would pick its device here (None = its default, e.g. "cuda:0") and
        # reject a device it cannot use with a ValueError naming it.
        if device not in (None, "cpu"):
            raise ValueError(f"the example backend runs on the CPU only: device must be 'cpu' or unset, got {device!r}")
        # The example leaves torch's thread pool alone; a real backend would size it here.
        self.threads = threads

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or None. Must not initialise a device it lacks;
        a GPU backend would return e.g. "torch.cuda.is_available() is False"."""
        return None

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)
