"""Device-generic torch kernels for zllm's GPU backends (CUDA, ROCm, Metal), usable on any torch device.

Each kernel has the signature of its op in ``zllm.capabilities.ops`` and is checked against
the core's f32 references on CPU tensors. :mod:`zllm_kernels_torch.table` lists them as
lazy ``"module:function"`` rows for a backend to register; :mod:`zllm_kernels_torch.device`
holds the device choice and weight placement those backends share. A library, not a
plugin: it has no entry point.
"""
