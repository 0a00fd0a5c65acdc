"""The backend instance: where tensors live. Constructed as ``ExampleBackend(threads=...)``
only after :meth:`unavailable_reason` said it can run."""

from __future__ import annotations

import torch


class ExampleBackend:
    name = "example"
    device = torch.device("cpu")

    def __init__(self, threads: int | None = None):
        # The example leaves torch's thread pool alone; a real backend would size it here.
        self.threads = threads

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or None. Must not initialise a device it lacks;
        a GPU backend would return e.g. "torch.cuda.is_available() is False"."""
        return None

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)
