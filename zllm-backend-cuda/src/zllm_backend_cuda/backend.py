"""The CUDA backend instance: one NVIDIA GPU through torch."""

from __future__ import annotations

import torch

from zllm_kernels_torch.device import TorchCudaBackend, triton_import_error
from zllm_kernels_torch.table import BF16_WEIGHT_CAPABILITIES

#: bf16 tensor-core GEMMs and conversions arrived with Ampere (compute capability 8.0).
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)


def bf16_unsupported(compute_capability: tuple[int, int], device_name: str) -> dict[str, str]:
    """The bf16 weight capabilities a GPU of ``compute_capability`` lacks, each with the reason (empty on sm_80+)."""
    if compute_capability >= BF16_MIN_COMPUTE_CAPABILITY:
        return {}
    major, minor = compute_capability
    why = f"bf16 weights need compute capability 8.0 (sm_80) or newer; {device_name} is sm_{major}{minor}"
    return dict.fromkeys(BF16_WEIGHT_CAPABILITIES, why)


class CudaBackend(TorchCudaBackend):
    """An NVIDIA GPU through a CUDA build of torch (see :class:`~zllm_kernels_torch.device.TorchDeviceBackend`
    for ``threads`` and ``device``)."""

    name = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.hip is not None:
            return f"this torch is a ROCm build (torch.version.hip={torch.version.hip}); use backend rocm"
        if not torch.cuda.is_available():
            return "no CUDA device visible (torch.cuda.is_available() is False)"
        return triton_import_error()

    def unsupported_capabilities(self) -> dict[str, str]:
        """bf16 weights on GPUs below sm_80 (``zllm.capabilities.backend``)."""
        return bf16_unsupported(torch.cuda.get_device_capability(self.device), torch.cuda.get_device_name(self.device))
