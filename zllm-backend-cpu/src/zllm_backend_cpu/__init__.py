"""zllm backend: torch CPU kernels (f32/f16/bf16 dense; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
K-quants block-quantized)."""

__version__ = "0.1.0"
