"""zllm-kernels-triton's kernels built with :data:`~zllm_backend_rocm.tuning.ROCM_TUNING`, as module
attributes ``<op>_<variant>``; imported by the registry on the first lookup (imports Triton)."""

from zllm_backend_rocm.tuning import ROCM_TUNING
from zllm_kernels_torch.table import named_kernels
from zllm_kernels_triton import kernel_table

globals().update(named_kernels(kernel_table(ROCM_TUNING)))
