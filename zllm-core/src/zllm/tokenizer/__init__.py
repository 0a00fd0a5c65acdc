"""Tokenizer layer: HF ``tokenizer.json`` and GGUF vocabularies, chat templates, incremental
detokenization.

Imports only :mod:`zllm.spec` from zllm.
"""

from zllm.tokenizer.chat import render_chat, render_chat_text
from zllm.tokenizer.detokenizer import IncrementalDetokenizer
from zllm.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "render_chat", "render_chat_text"]
