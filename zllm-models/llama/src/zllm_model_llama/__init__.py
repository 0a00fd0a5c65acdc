"""zllm model family for the llama architecture (HF ``model_type: llama``, GGUF ``llama``)."""

__version__ = "0.1.0"
