"""Tokenizer layer: HF ``tokenizer.json`` and GGUF vocabularies, incremental detokenization.

Imports only :mod:`zllm.spec` from zllm.
"""

from zllm.tokenizer.detokenizer import IncrementalDetokenizer
from zllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
