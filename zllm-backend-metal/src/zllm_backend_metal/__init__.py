"""zllm's Metal backend: Apple GPUs through torch's MPS device (entry point ``metal``)."""
