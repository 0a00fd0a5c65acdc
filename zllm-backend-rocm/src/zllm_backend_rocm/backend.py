"""The ROCm backend instance: one AMD GPU through the HIP build of torch (``torch.cuda`` API)."""

from __future__ import annotations

import torch

from zllm_kernels_torch.device import TorchCudaBackend, triton_import_error
from zllm_kernels_torch.table import BF16_WEIGHT_CAPABILITIES

#: gfx arch prefixes with bf16 matrix instructions: CDNA2 (MI200), CDNA3 (MI300), CDNA4
#: (MI350), RDNA3 and RDNA4 (WMMA).
BF16_ARCH_PREFIXES = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def bf16_unsupported(gcn_arch_name: str) -> dict[str, str]:
    """The bf16 weight capabilities a GPU of ``gcn_arch_name`` (e.g. ``gfx90a:sramecc+:xnack-``)
    lacks, each with the reason; empty for the arches of :data:`BF16_ARCH_PREFIXES`."""
    arch = gcn_arch_name.split(":")[0]
    if arch.startswith(BF16_ARCH_PREFIXES):
        return {}
    why = f"bf16 weights need gfx90a, gfx94x/gfx95x, gfx11xx or gfx12xx; this GPU is {arch}"
    return dict.fromkeys(BF16_WEIGHT_CAPABILITIES, why)


class RocmBackend(TorchCudaBackend):
    """An AMD GPU through a ROCm build of torch, which exposes it as device type ``cuda`` (see
    :class:`~zllm_kernels_torch.device.TorchDeviceBackend` for ``threads`` and ``device``)."""

    name = "rocm"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.hip is None:
            return "this torch is not a ROCm build (torch.version.hip is None)"
        if not torch.cuda.is_available():
            return "no ROCm device visible (torch.cuda.is_available() is False)"
        return triton_import_error()

    def unsupported_capabilities(self) -> dict[str, str]:
        """bf16 weights on arches without bf16 matrix instructions (``zllm.capabilities.backend``)."""
        return bf16_unsupported(torch.cuda.get_device_properties(self.device).gcnArchName)
