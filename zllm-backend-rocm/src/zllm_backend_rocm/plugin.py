"""Entry point of the ``zllm-backend-rocm`` distribution (group ``zllm``, name ``rocm``).

The kernel split is the CUDA backend's: zllm-kernels-triton for the ops it covers, built
with :data:`~zllm_backend_rocm.tuning.ROCM_TUNING` (Triton's AMD target) by
:mod:`zllm_backend_rocm.kernels` on the first lookup, and zllm-kernels-torch for embedding,
dense linear (rocBLAS / hipBLASLt) and sampling. Nothing here imports Triton or HIP.
"""

from zllm_kernels_torch.hooks import backend_hooks
from zllm_kernels_torch.table import GPU_TORCH_CAPABILITIES, lazy_rows, torch_rows
from zllm_kernels_triton import OPS

ZLLM_PLUGIN_API = "1.0"
KERNELS = torch_rows(GPU_TORCH_CAPABILITIES) + lazy_rows("zllm_backend_rocm.kernels", OPS)

zllm_backends, zllm_register_kernels = backend_hooks(
    "rocm", "zllm_backend_rocm.backend:RocmBackend", KERNELS, priority=20, registered_by="zllm-backend-rocm",
    description="AMD GPUs (ROCm/HIP): Triton kernels + rocBLAS GEMMs; weights f32/f16/bf16/Q8_0; "
                "FP8, INT4/INT8 groups, MXFP4, NVFP4 in linear and the MoE experts")
