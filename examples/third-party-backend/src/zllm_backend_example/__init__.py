"""zllm-backend-example: the smallest complete zllm backend (plain torch, f32 weights).

Importing this package imports nothing heavy; zllm imports ``plugin`` through the entry
point and the kernels only when a model binds them.
"""
