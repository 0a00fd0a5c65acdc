"""What the torch GPU backends share: picking the device and placing tensors on it.

A backend subclasses :class:`TorchDeviceBackend` (Metal) or :class:`TorchCudaBackend`
(CUDA and ROCm: HIP builds of torch expose AMD GPUs through the same ``torch.cuda`` API and
the ``cuda`` device type) and adds its ``unavailable_reason`` and, where a device may lack
a declared capability, ``unsupported_capabilities`` (see ``zllm.capabilities.backend``).
"""

from __future__ import annotations

import torch


class TorchDeviceBackend:
    """One torch device of type :attr:`device_type`.

    Args:
        threads: not used: these kernels run on the device, not on a host thread pool (the
            loader passes ``backend.threads`` to every backend).
        device: ``None`` for device 0 of this type, or a torch device string such as
            ``"cuda:1"``.

    Raises:
        ValueError: ``device`` does not parse, is of another type, or names a device index
            that does not exist (names the devices that do).
    """

    name: str
    device_type: str

    def __init__(self, threads: int | None = None, device: str | None = None):
        del threads
        self.device = self._parse(device)

    @classmethod
    def device_count(cls) -> int:
        """How many devices of :attr:`device_type` torch sees."""
        raise NotImplementedError

    def _parse(self, device: str | None) -> torch.device:
        try:
            dev = torch.device(self.device_type if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"backend {self.name}: device {device!r} is not a torch device string ({exc})") from None
        if dev.type != self.device_type:
            raise ValueError(f"backend {self.name}: device {device!r} is not a {self.device_type!r} device "
                             f"(expected e.g. '{self.device_type}:0')")
        count = self.device_count()
        index = 0 if dev.index is None else dev.index
        if index >= count:
            visible = ", ".join(f"{self.device_type}:{i}" for i in range(count)) or "none"
            what = repr(device) if device is not None else f"'{self.device_type}:0' (the default)"
            raise ValueError(f"backend {self.name}: device {what} does not exist; visible {self.device_type} "
                             f"devices: {visible}")
        return torch.device(self.device_type, index)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (any dtype; the bytes of a quantized weight) on this backend's device."""
        return tensor.to(self.device)


class TorchCudaBackend(TorchDeviceBackend):
    """A GPU behind torch's ``torch.cuda`` API (NVIDIA CUDA and AMD HIP builds alike).

    Construction makes the chosen GPU torch's current device: Triton launches on the
    current device, not on its tensors' one.
    """

    device_type = "cuda"
    process_group_backend = "nccl"
    """torch.distributed's backend for several ranks (``parallel``): NCCL, which ROCm's RCCL also answers to."""

    def __init__(self, threads: int | None = None, device: str | None = None):
        super().__init__(threads, device)
        torch.cuda.set_device(self.device)

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    def available_memory_bytes(self) -> int:
        """Free bytes on this GPU as the driver reports them (``cudaMemGetInfo`` /
        ``hipMemGetInfo``); the core sizes an automatic KV cache from it."""
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free)


def triton_import_error() -> str | None:
    """Why ``import triton`` fails here, or ``None`` when it works."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # any failure: missing wheel, broken install, missing compiler runtime
        return f"triton cannot be imported ({type(exc).__name__}: {exc}); install the triton wheel for this torch"
    return None
