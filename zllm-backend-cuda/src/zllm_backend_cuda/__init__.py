"""zllm's CUDA backend: NVIDIA GPUs through torch, with Triton kernels (entry point ``cuda``)."""
