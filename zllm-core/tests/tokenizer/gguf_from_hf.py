"""Write a vocabulary-only GGUF from an HF tokenizer folder the way llama.cpp's converter does.

``convert_hf_to_gguf.py`` (llama.cpp ``conversion/base.py``, ``TextModel._set_vocab_gpt2`` and
``get_vocab_base``): tokens by id (``[PADi]`` of type UNUSED for holes), added tokens CONTROL
when they are special or look special (``<|...|>``, ``<｜...｜>``), else USER_DEFINED; then
``gguf.SpecialVocab(dir, load_merges=True)`` adds the merges, BOS/EOS ids, ``add_bos_token`` /
``add_eos_token`` and ``chat_template`` from ``tokenizer.json`` and ``tokenizer_config.json``.
The converter picks ``tokenizer.ggml.pre`` by hashing the encoding of a probe text; here the
caller names it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from tokenizers import Tokenizer as HFTokenizer


def _looks_special(text: str) -> bool:
    # TextModel.does_token_look_special.
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def write_vocab_gguf(hf_dir: Path, out: Path, pre: str) -> Path:
    """Write ``out`` from ``hf_dir/tokenizer.json`` (+ ``tokenizer_config.json`` when present)."""
    hf = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = hf.get_vocab(with_added_tokens=True)
    added = hf.get_added_tokens_decoder()
    by_id = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        text = by_id[i]
        if i in added:
            if not added[i].normalized:
                text = hf.decode(
                    hf.encode(text, add_special_tokens=False).ids, skip_special_tokens=False
                )
            special = added[i].special or _looks_special(text)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(text)

    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
