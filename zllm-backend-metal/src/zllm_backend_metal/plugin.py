"""Entry point of the ``zllm-backend-metal`` distribution (group ``zllm``, name ``metal``).

Every kernel is zllm-kernels-torch's, run on the MPS device: the rows are that library's
whole :data:`~zllm_kernels_torch.table.TORCH_KERNELS`.
"""

from zllm_kernels_torch.hooks import backend_hooks
from zllm_kernels_torch.table import TORCH_KERNELS

ZLLM_PLUGIN_API = "1.3"

zllm_backends, zllm_register_kernels = backend_hooks(
    "metal", "zllm_backend_metal.backend:MetalBackend", list(TORCH_KERNELS), priority=10,
    registered_by="zllm-backend-metal",
    description="Apple GPUs through torch MPS; weights f32/f16/bf16 (macOS 14+)/Q8_0")
