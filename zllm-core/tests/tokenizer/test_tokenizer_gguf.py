"""GGUF vocabularies reproduce llama.cpp's SentencePiece tokenizer (its test-tokenizer-0 vectors)."""

from __future__ import annotations

import struct

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spm_reference import spm_tokenize
from tokdata import STORIES_GGUF, VOCABS, read_vocab_vectors, texts

from zllm.spec.errors import CheckpointError
from zllm.tokenizer import Tokenizer

LLAMA_SPM_VECTORS = read_vocab_vectors("llama-spm")
PHI3_VECTORS = read_vocab_vectors("phi-3")


def test_vector_files_hold_46_cases_including_the_empty_string():
    assert len(LLAMA_SPM_VECTORS) == len(PHI3_VECTORS) == 46
    assert ("", []) in LLAMA_SPM_VECTORS
    assert LLAMA_SPM_VECTORS[-1][0].endswith("We'Ve a'lL")  # the long last case is not cut


@pytest.mark.parametrize(("text", "expected"), LLAMA_SPM_VECTORS, ids=range(len(LLAMA_SPM_VECTORS)))
def test_llama_spm_vocab_reproduces_llama_cpp_vectors(llama_spm, text, expected):
    assert llama_spm.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize(("text", "expected"), PHI3_VECTORS, ids=range(len(PHI3_VECTORS)))
def test_phi3_vocab_reproduces_llama_cpp_vectors(phi3, text, expected):
    assert phi3.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize(("text", "expected"), LLAMA_SPM_VECTORS, ids=range(len(LLAMA_SPM_VECTORS)))
def test_python_transcription_of_llama_cpp_reproduces_the_vectors(llama_spm_meta, llama_spm_ids, text, expected):
    # Validates the oracle used by the generated-text test below.
    assert spm_tokenize(text, llama_spm_ids, llama_spm_meta["tokenizer.ggml.scores"]) == expected


# Whitespace runs matter most: llama-spm gives every "▁…▁" token the same score (-1e9), so
# llama.cpp's leftmost-first tie-break is what decides how a run of spaces splits.
spm_texts = st.one_of(
    texts,
    st.lists(st.sampled_from([" ", " " * 3, " " * 7, "\n", "\t", "a", "Hello", "🦙", "中"]), max_size=20).map("".join),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=spm_texts)
def test_llama_spm_vocab_matches_llama_cpp_algorithm_on_generated_text(llama_spm, llama_spm_meta, llama_spm_ids, text):
    # With parse_special=False and no user-defined tokens in this vocabulary, llama.cpp
    # tokenizes the whole text as one fragment.
    expected = spm_tokenize(text, llama_spm_ids, llama_spm_meta["tokenizer.ggml.scores"])
    assert llama_spm.encode(text, add_special_tokens=False) == expected


def test_vocab_only_gguf_loads_with_metadata_bos_eos(llama_spm, phi3):
    header = (VOCABS / "ggml-vocab-llama-spm.gguf").read_bytes()[:16]
    assert header[:4] == b"GGUF" and struct.unpack_from("<Q", header, 8) == (0,)  # tensor_count
    assert (llama_spm.vocab_size, llama_spm.bos_token_id, llama_spm.eos_token_ids) == (32000, 1, (2,))
    # Phi-3's EOS, then llama.cpp's end-of-generation tokens found by text: </s>, <|end|>.
    assert (phi3.vocab_size, phi3.bos_token_id, phi3.eos_token_ids) == (32064, 1, (32000, 2, 32007))
    assert llama_spm.add_bos and not llama_spm.add_eos
    assert llama_spm.source.endswith("ggml-vocab-llama-spm.gguf")


def test_tiny_random_gguf_loads_the_llama2_vocab_with_llama_cpp_defaults(tiny_random):
    # The file has no add_bos/add_eos keys: llama.cpp's SPM defaults are add_bos=True, add_eos=False.
    assert tiny_random.vocab_size == 32000
    assert (tiny_random.bos_token_id, tiny_random.eos_token_ids) == (1, (2,))
    assert tiny_random.add_bos and not tiny_random.add_eos
    assert tiny_random.id_to_token(15043) == "▁Hello"
    assert tiny_random.token_to_id("<0x0A>") == 13


@pytest.mark.parametrize("case", [0, 1, 11, 12, 18, 20, 22, 33, 44, 45])
def test_tiny_random_gguf_agrees_with_llama_spm_vectors(tiny_random, case):
    text, expected = LLAMA_SPM_VECTORS[case]
    assert tiny_random.encode(text, add_special_tokens=False) == expected
    assert tiny_random.encode(text) == [1, *expected]


def test_special_token_text_is_plain_text_unless_parse_special(llama_spm):
    assert llama_spm.encode("</s>", add_special_tokens=False) != [2]
    assert 2 not in llama_spm.encode("<s></s>hi")
    assert llama_spm.encode("</s>", add_special_tokens=False, parse_special=True) == [2]
    assert llama_spm.encode("<s>hi", parse_special=True)[:2] == [1, 1]


def test_end_of_generation_text_gets_the_control_bit_even_when_user_defined(phi3):
    # phi-3 stores "</s>" as user-defined (type 4); llama.cpp adds the control attribute to
    # every end-of-generation text, so it is matched only when special tokens are parsed.
    assert phi3.token_to_id("</s>") == 2 and 2 in phi3.eos_token_ids
    assert phi3.encode("</s>", add_special_tokens=False) != [2]
    assert phi3.encode("</s>", add_special_tokens=False, parse_special=True) == [2]
    assert phi3.encode("<|end|>", add_special_tokens=False) != [32007]  # a control token: text
    assert phi3.encode("<|end|>", add_special_tokens=False, parse_special=True) == [32007]


def test_decode_skips_control_tokens_and_renders_user_defined_ones(phi3, mpt):
    ids = phi3.encode("<|user|>Hi</s>", parse_special=True)
    assert phi3.decode(ids) == "Hi"
    assert phi3.decode(ids, skip_special_tokens=False) == "<s><|user|> Hi</s>"
    spaces = mpt.token_to_id("    ")  # user-defined in GPT-NeoX's vocabulary
    assert mpt.decode([*mpt.encode("a", add_special_tokens=False), spaces]) == "a    "


def test_decode_inverts_encode_for_llama_spm_vectors(llama_spm):
    for text, expected in LLAMA_SPM_VECTORS:
        # SentencePiece drops nothing: decode(encode(x)) == x (the dummy-prefix space is stripped).
        assert llama_spm.decode(expected) == text


def _stories_meta() -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(STORIES_GGUF).fields.items()}


def test_missing_add_bos_keys_use_llama_cpp_spm_defaults():
    meta = _stories_meta()
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.bos_token_id"):
        del meta[key]
    tok = Tokenizer.from_gguf_metadata(meta, "stories.gguf")
    assert (tok.add_bos, tok.add_eos, tok.bos_token_id) == (True, False, 1)
    assert tok.encode("Zoo") == [1, 410, 469, 347]


def test_add_eos_key_appends_eos():
    meta = _stories_meta()
    meta["tokenizer.ggml.add_eos_token"] = True
    meta["tokenizer.ggml.add_bos_token"] = False
    assert Tokenizer.from_gguf_metadata(meta, "stories.gguf").encode("Zoo") == [410, 469, 347, 2]


def test_unsupported_tokenizer_model_names_the_file_the_value_and_the_supported_ones():
    meta = _stories_meta()
    meta["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(CheckpointError,
                       match=r"x\.gguf: unsupported tokenizer\.ggml\.model 'rwkv'; supported: 'llama', 'gpt2'"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")


def test_gguf_without_a_vocabulary_raises_checkpoint_error():
    meta = {k: v for k, v in _stories_meta().items() if not k.startswith("tokenizer.")}
    with pytest.raises(CheckpointError, match="no 'tokenizer.ggml.model' key"):
        Tokenizer.from_gguf_metadata(meta, "weights.gguf")


def test_inconsistent_token_lists_raise_checkpoint_error():
    meta = _stories_meta()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(CheckpointError, match="512 tokens, 511 scores"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")


def _stories_cut_points() -> list[int]:
    size = STORIES_GGUF.stat().st_size
    data_offset = gguf.GGUFReader(STORIES_GGUF).data_offset
    # In the header, the key/values, the tensor infos, the tensor data, and one byte short.
    return [0, 8, 24, 5000, data_offset - 10, data_offset + 100_000, size - 1]


@pytest.mark.parametrize("cut", _stories_cut_points())
def test_truncated_gguf_raises_checkpoint_error_naming_the_file(tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(STORIES_GGUF.read_bytes()[:cut])
    with pytest.raises(CheckpointError, match="corrupt or truncated GGUF file") as info:
        Tokenizer.from_gguf_file(path)
    assert info.value.file == str(path)
    assert str(info.value).startswith(str(path))


def test_non_gguf_file_raises_checkpoint_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(4096))
    with pytest.raises(CheckpointError, match="model.gguf"):
        Tokenizer.from_gguf_file(path)


def test_missing_gguf_file_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="nope.gguf"):
        Tokenizer.from_gguf_file(tmp_path / "nope.gguf")
