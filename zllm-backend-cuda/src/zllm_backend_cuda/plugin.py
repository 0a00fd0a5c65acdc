"""Entry point of the ``zllm-backend-cuda`` distribution (group ``zllm``, name ``cuda``).

Kernels: every op of zllm-kernels-triton, built with :data:`~zllm_backend_cuda.tuning.CUDA_TUNING`
by :mod:`zllm_backend_cuda.kernels` on the first lookup, plus zllm-kernels-torch's
embedding, dense linear (cuBLAS) and sampling. Publishing and registering import neither
Triton nor a CUDA runtime.
"""

from zllm_kernels_torch.hooks import backend_hooks
from zllm_kernels_torch.table import GPU_TORCH_CAPABILITIES, lazy_rows, torch_rows
from zllm_kernels_triton import OPS

ZLLM_PLUGIN_API = "1.3"
KERNELS = torch_rows(GPU_TORCH_CAPABILITIES) + lazy_rows("zllm_backend_cuda.kernels", OPS)

zllm_backends, zllm_register_kernels = backend_hooks(
    "cuda", "zllm_backend_cuda.backend:CudaBackend", KERNELS, priority=20, registered_by="zllm-backend-cuda",
    description="NVIDIA GPUs: Triton kernels + cuBLAS GEMMs; weights f32/f16/bf16/Q8_0; "
                "FP8, INT4/INT8 groups, MXFP4, NVFP4 in linear and the MoE experts")
