"""The Metal backend instance: the Apple GPU through torch's MPS device."""

from __future__ import annotations

import torch

from zllm_kernels_torch.device import TorchDeviceBackend
from zllm_kernels_torch.table import BF16_WEIGHT_CAPABILITIES


def bf16_unsupported(macos_14_or_newer: bool) -> dict[str, str]:
    """The bf16 weight capabilities MPS lacks before macOS 14, each with the reason."""
    if macos_14_or_newer:
        return {}
    return dict.fromkeys(BF16_WEIGHT_CAPABILITIES, "bf16 on MPS needs macOS 14 or newer")


class MetalBackend(TorchDeviceBackend):
    """torch's MPS device (one per machine; ``device`` may be ``None``, ``"mps"`` or ``"mps:0"``)."""

    name = "metal"
    device_type = "mps"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.backends.mps.is_available():
            return "no Metal device visible (torch.backends.mps.is_available() is False)"
        return None

    @classmethod
    def device_count(cls) -> int:
        return 1

    def unsupported_capabilities(self) -> dict[str, str]:
        """bf16 weights before macOS 14 (``zllm.capabilities.backend``)."""
        return bf16_unsupported(torch.backends.mps.is_macos_or_newer(14, 0))
