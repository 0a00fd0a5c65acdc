"""zllm's ROCm backend: AMD GPUs through torch's HIP build, with Triton kernels (entry point ``rocm``)."""
