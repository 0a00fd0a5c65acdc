"""Byte-level BPE GGUF vocabularies (``tokenizer.ggml.model = gpt2``) reproduce llama.cpp's
test-tokenizer-0 vectors, a file without a pre type gets llama.cpp's default, and unknown pre
types are refused by name."""

from __future__ import annotations

import logging

import pytest
from tokdata import VOCABS, read_vocab_vectors

from zllm.spec.errors import CheckpointError
from zllm.tokenizer import Tokenizer
from zllm.tokenizer.bpe_pre import BPE_PRE_TYPES_BY_NAME

GPT2_VECTORS = read_vocab_vectors("gpt-2")
MPT_VECTORS = read_vocab_vectors("mpt")


def test_vector_files_hold_46_cases():
    assert len(GPT2_VECTORS) == len(MPT_VECTORS) == 46
    assert ("", []) in GPT2_VECTORS


@pytest.mark.parametrize(("text", "expected"), GPT2_VECTORS, ids=range(len(GPT2_VECTORS)))
def test_gpt2_vocab_reproduces_llama_cpp_vectors(gpt2, text, expected):
    assert gpt2.encode(text, add_special_tokens=False) == expected
    assert gpt2.decode(expected) == text  # byte-level BPE is lossless


@pytest.mark.parametrize(("text", "expected"), MPT_VECTORS, ids=range(len(MPT_VECTORS)))
def test_mpt_vocab_reproduces_llama_cpp_vectors(mpt, text, expected):
    assert mpt.encode(text, add_special_tokens=False) == expected
    assert mpt.decode(expected) == text


def test_the_vocab_files_pre_types_are_the_vector_verified_entries(gpt2_meta, mpt):
    assert gpt2_meta["tokenizer.ggml.pre"] == "gpt-2"
    assert "ggml-vocab-gpt-2" in BPE_PRE_TYPES_BY_NAME["gpt-2"].verified_by
    assert "ggml-vocab-mpt" in BPE_PRE_TYPES_BY_NAME["mpt"].verified_by


def test_bpe_defaults_follow_llama_cpp_add_bos_false(gpt2, mpt):
    # Neither file has add_bos/add_eos keys; llama.cpp's BPE default is add_bos = false
    # (llama_vocab::impl::load: only llama3-family and tekken pre types set it).
    assert (gpt2.bos_token_id, gpt2.eos_token_ids, gpt2.add_bos, gpt2.add_eos) == (50256, (50256,), False, False)
    assert (mpt.bos_token_id, mpt.eos_token_ids, mpt.add_bos) == (0, (0,), False)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257 and mpt.vocab_size == 50432


def test_add_bos_key_overrides_the_default(gpt2_meta):
    tok = Tokenizer.from_gguf_metadata({**gpt2_meta, "tokenizer.ggml.add_bos_token": True}, "g.gguf")
    assert tok.encode("Hello world") == [50256, 15496, 995]


def test_special_token_text_is_plain_unless_parse_special(gpt2):
    assert gpt2.encode("<|endoftext|>", add_special_tokens=False) != [50256]
    assert gpt2.encode("a<|endoftext|>", add_special_tokens=False, parse_special=True) == [64, 50256]
    assert gpt2.special_token_texts == ("<|endoftext|>",)


def test_mpt_user_defined_space_runs_are_split_out(mpt):
    # GPT-NeoX's added "  " … tokens are user-defined (type 4): matched in raw text first.
    assert mpt.token_to_id("    ") == 50274
    assert mpt.encode("a    b", add_special_tokens=False)[1] == 50274


@pytest.mark.parametrize("pre", ["made-up", "kimi-k2", "LLAMA-BPE", ""])
def test_unknown_pre_type_names_it_and_the_known_ones(gpt2_meta, pre):
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_gguf_metadata({**gpt2_meta, "tokenizer.ggml.pre": pre}, "x.gguf")
    msg = str(info.value)
    assert msg.startswith("x.gguf: unknown pre-tokenizer type tokenizer.ggml.pre " + repr(pre))
    assert "; known: a.x-4.0, bloom," in msg and " llama-bpe," in msg and " qwen2," in msg


def test_file_without_pre_type_gets_llama_cpps_default_with_its_warning(caplog):
    # llama.cpp's GPT-NeoX vocabulary predates tokenizer.ggml.pre; it has the same tokens as mpt.
    path = VOCABS / "ggml-vocab-gpt-neox.gguf"
    with caplog.at_level(logging.WARNING, logger="zllm.tokenizer.gguf_vocab"):
        neox = Tokenizer.from_gguf_file(path)
    assert "without 'tokenizer.ggml.pre'; using llama.cpp's 'default'" in caplog.text
    assert str(path) in caplog.text
    # The default type isolates punctuation runs and cuts digit runs in threes.
    text = "x (1234)!"
    pieces = [neox.id_to_token(i) for i in neox.encode(text, add_special_tokens=False)]
    assert pieces == ["x", "Ġ", "(", "123", "4", ")!"]
    assert neox.decode(neox.encode(text)) == text
    assert (neox.bos_token_id, neox.eos_token_ids, neox.add_bos) == (0, (0,), False)


def test_missing_merges_is_an_error(gpt2_meta):
    meta = {k: v for k, v in gpt2_meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.merges' is missing"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")


def test_unsupported_tokenizer_model_lists_both_supported_models(gpt2_meta):
    with pytest.raises(CheckpointError, match="unsupported tokenizer.ggml.model 'rwkv'; supported: 'llama', 'gpt2'"):
        Tokenizer.from_gguf_metadata({**gpt2_meta, "tokenizer.ggml.model": "rwkv"}, "x.gguf")


def test_bpe_vocab_without_template_has_no_chat_template(gpt2):
    assert gpt2.chat_template is None and gpt2.chat_templates == {}
