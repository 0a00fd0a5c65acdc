"""Byte-level BPE GGUF vocabularies (``tokenizer.ggml.model = gpt2``) reproduce llama.cpp's
test-tokenizer-0 vectors, and unsupported pre-tokenizer types are refused by name."""

from __future__ import annotations

import pytest
from tokdata import read_vocab_vectors

from zllm.spec.errors import CheckpointError
from zllm.tokenizer import Tokenizer
from zllm.tokenizer.gguf_vocab import BPE_PRE_TOKENIZERS

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


def test_every_supported_pre_type_is_backed_by_shipped_vectors():
    assert {p.verified_by for p in BPE_PRE_TOKENIZERS.values()} <= {"gpt-2", "mpt"}
    assert {"gpt-2", "mpt"} <= set(BPE_PRE_TOKENIZERS)


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


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default", "made-up"])
def test_unknown_pre_type_names_it_and_the_supported_ones(gpt2_meta, pre):
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_gguf_metadata({**gpt2_meta, "tokenizer.ggml.pre": pre}, "x.gguf")
    msg = str(info.value)
    assert msg.startswith("x.gguf: unknown pre-tokenizer type tokenizer.ggml.pre " + repr(pre))
    assert "supported: 'gpt-2', 'phi-2', 'mpt'" in msg


def test_missing_pre_type_is_an_error_not_a_silent_default(gpt2_meta):
    meta = {k: v for k, v in gpt2_meta.items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(CheckpointError, match="without a 'tokenizer.ggml.pre' key.*'default'.*supported"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")


def test_missing_merges_is_an_error(gpt2_meta):
    meta = {k: v for k, v in gpt2_meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(CheckpointError, match="'tokenizer.ggml.merges' is missing"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")


def test_unsupported_tokenizer_model_lists_both_supported_models(gpt2_meta):
    with pytest.raises(CheckpointError, match="unsupported tokenizer.ggml.model 'rwkv'; supported: 'llama', 'gpt2'"):
        Tokenizer.from_gguf_metadata({**gpt2_meta, "tokenizer.ggml.model": "rwkv"}, "x.gguf")


def test_bpe_vocab_without_template_has_no_chat_template(gpt2):
    assert gpt2.chat_template is None and gpt2.chat_templates == {}
