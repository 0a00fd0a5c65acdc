"""zllm model family for DeepSeek-V2/V3.

HF ``model_type`` ``deepseek_v2`` and ``deepseek_v3``, GGUF ``deepseek2``.
"""

__version__ = "0.1.0"
