"""Fixtures for the tokenizer tests. Every tokenizer is built once per session: the
32,000-token GGUF vocabularies take about 2 s each to read with ``gguf.GGUFReader``.
"""

from __future__ import annotations

import os

import gguf
import pytest
from tokdata import STORIES_GGUF, STORIES_HF, TINY_RANDOM_GGUF, VOCABS, load_json

from zllm.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def stories_hf() -> Tokenizer:
    return Tokenizer.from_hf_files(
        STORIES_HF / "tokenizer.json",
        load_json(STORIES_HF / "tokenizer_config.json"),
        load_json(STORIES_HF / "generation_config.json"),
    )


@pytest.fixture(scope="session")
def stories_gguf() -> Tokenizer:
    return Tokenizer.from_gguf_file(STORIES_GGUF)


@pytest.fixture(scope="session")
def llama_spm_meta() -> dict:
    """Decoded metadata of llama.cpp's Llama SentencePiece vocabulary file (no tensors)."""
    reader = gguf.GGUFReader(VOCABS / "ggml-vocab-llama-spm.gguf")
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="session")
def llama_spm_ids(llama_spm_meta) -> dict[str, int]:
    """Token text → id of the llama-spm vocabulary, for the llama.cpp transcription."""
    return {t: i for i, t in enumerate(llama_spm_meta["tokenizer.ggml.tokens"])}


@pytest.fixture(scope="session")
def llama_spm(llama_spm_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(llama_spm_meta, str(VOCABS / "ggml-vocab-llama-spm.gguf"))


@pytest.fixture(scope="session")
def phi3() -> Tokenizer:
    return Tokenizer.from_gguf_file(VOCABS / "ggml-vocab-phi-3.gguf")


@pytest.fixture(scope="session")
def tiny_random() -> Tokenizer:
    return Tokenizer.from_gguf_file(TINY_RANDOM_GGUF)


@pytest.fixture(scope="session")
def stories_transformers():
    """HF transformers' tokenizer for the stories260k checkpoint, from local files only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(STORIES_HF), split_special_tokens=True, local_files_only=True)


def _gguf_meta(name: str) -> dict:
    reader = gguf.GGUFReader(VOCABS / f"ggml-vocab-{name}.gguf")
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="session")
def gpt2_meta() -> dict:
    """Decoded metadata of llama.cpp's GPT-2 byte-level BPE vocabulary (``tokenizer.ggml.pre = gpt-2``)."""
    return _gguf_meta("gpt-2")


@pytest.fixture(scope="session")
def gpt2(gpt2_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gpt2_meta, str(VOCABS / "ggml-vocab-gpt-2.gguf"))


@pytest.fixture(scope="session")
def mpt() -> Tokenizer:
    """llama.cpp's MPT vocabulary (GPT-NeoX BPE, ``tokenizer.ggml.pre = mpt``, user-defined space runs)."""
    return Tokenizer.from_gguf_file(VOCABS / "ggml-vocab-mpt.gguf")
