"""zllm backend: torch CPU kernels (f32/f16/bf16 dense, Q8_0/Q4_0 block-quantized)."""

__version__ = "0.1.0"
