"""GPT-2's byte-level BPE as an HF ``tokenizers`` tokenizer, built from the vocabulary and merges
in llama.cpp's shipped ``ggml-vocab-gpt-2.gguf`` (GPT-2's own pre-tokenizer and decoder:
byte-level, no prefix space). llama.cpp's converter refuses the Llama SentencePiece tokenizer
for ``qwen2moe``, ``qwen3moe``, ``deepseek2`` and ``gpt-oss`` files and recognises this one
(``tokenizer.ggml.pre = gpt-2``), so the MoE test checkpoints and the bench's MoE models carry it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

GPT2_VOCAB = Path(__file__).resolve().parents[1] / "assets" / "models" / "llama.cpp-vocab" / "ggml-vocab-gpt-2.gguf"
#: GPT-2's vocabulary size; its last token, ``<|endoftext|>``, is BOS, EOS and UNK.
GPT2_VOCAB_SIZE = 50257


@functools.cache
def _serialized() -> str:
    """The tokenizer as JSON, built once per process (reading the vocabulary file takes seconds)."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    fields = gguf.GGUFReader(str(GPT2_VOCAB)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == GPT2_VOCAB_SIZE, tok.get_vocab_size()
    return tok.to_str()


def gpt2_tokenizer():
    """A fresh ``tokenizers.Tokenizer`` of GPT-2's BPE (callers may add tokens to it)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_serialized())


def write_gpt2_tokenizer(dst: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (``<|endoftext|>`` as BOS, EOS and UNK) into ``dst``."""
    (dst / "tokenizer.json").write_text(_serialized(), encoding="utf-8")
    eos = gpt2_tokenizer().id_to_token(GPT2_VOCAB_SIZE - 1)
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": eos, "eos_token": eos, "unk_token": eos,
         "add_prefix_space": False}, indent=2) + "\n")
