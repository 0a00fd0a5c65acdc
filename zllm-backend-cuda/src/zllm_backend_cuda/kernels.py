"""zllm-kernels-triton's kernels built with :data:`~zllm_backend_cuda.tuning.CUDA_TUNING`, as
module attributes ``<op>_<variant>`` (``rms_norm_f32``, ``rope_neox`` ...).

The registry imports this module on the first lookup of one of them; importing it imports
Triton (set ``TRITON_INTERPRET=1`` before that to run the kernels on the CPU).
"""

from zllm_backend_cuda.tuning import CUDA_TUNING
from zllm_kernels_torch.table import named_kernels
from zllm_kernels_triton import kernel_table

globals().update(named_kernels(kernel_table(CUDA_TUNING)))
