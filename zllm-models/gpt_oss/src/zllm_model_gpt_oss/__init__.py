"""zllm model family for OpenAI's gpt-oss.

HF ``model_type`` ``gpt_oss``, GGUF ``gpt-oss``.
"""

__version__ = "0.1.0"
