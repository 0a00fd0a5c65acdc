"""tokenizer.json loading: parity with HF transformers and with the same model's GGUF vocabulary."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokdata import STORIES_HF, load_json, texts

from zllm.spec.errors import CheckpointError
from zllm.tokenizer import Tokenizer

FIXED_TEXTS = [
    "", " ", "  ", "\n", "\n\n", "\t", "Zoo", "Hello world", " Hello world", "  Hello", "Hello  world  ",
    "Once upon a time, there was a little girl named Lily.", "Lily's mom said, \"Lily, let's go.\"\n",
    "<s>", "</s>", "<unk>", "<s>Zoo</s>", " </s> <s> ", "<0x41>", "\u2581", "\u2581Zoo",
    "héllo wörld", "Äpfel ñ", "🦙", "this is 🦙.cpp", "😶\u200d🌫️ ✅", "中文", "我想在apple工作1314151天～",
    "нещо на Български", "Cửa Việt", "ពិសេស", "e\u0301", "a\u00a0b", "line1\r\nline2", "!!!!!!", "333333",
]
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_zoo_encodes_to_the_published_ids_with_bos_on_both_paths(stories_hf, stories_gguf):
    assert stories_hf.encode("Zoo") == [1, 410, 469, 347]
    assert stories_gguf.encode("Zoo") == [1, 410, 469, 347]
    assert stories_hf.encode("Zoo", add_special_tokens=False) == [410, 469, 347]


def test_bos_eos_come_from_tokenizer_config_and_generation_config(stories_hf, stories_gguf):
    assert (stories_hf.bos_token_id, stories_hf.add_bos, stories_hf.add_eos) == (1, True, False)
    # generation_config.json lists 2 and 1; the tokenizer's own EOS (2) comes first.
    assert stories_hf.eos_token_ids == (2, 1)
    assert stories_gguf.eos_token_ids == (2,)
    assert stories_hf.source == str(STORIES_HF / "tokenizer.json")
    assert stories_hf.vocab_size == stories_gguf.vocab_size == 512


def test_without_configs_bos_comes_from_the_post_processor_template():
    tok = Tokenizer.from_hf_files(STORIES_HF / "tokenizer.json")
    assert (tok.bos_token_id, tok.add_bos, tok.add_eos, tok.eos_token_ids) == (1, True, False, ())
    assert tok.encode("Zoo") == [1, 410, 469, 347]


def test_tokenizer_config_flags_override_the_post_processor():
    config = {**load_json(STORIES_HF / "tokenizer_config.json"), "add_bos_token": False, "add_eos_token": True}
    tok = Tokenizer.from_hf_files(STORIES_HF / "tokenizer.json", config)
    assert tok.encode("Zoo") == [410, 469, 347, 2]


def test_config_special_token_missing_from_vocab_raises_checkpoint_error():
    with pytest.raises(CheckpointError, match="eos_token '<eot>' is not in the vocabulary"):
        Tokenizer.from_hf_files(STORIES_HF / "tokenizer.json", {"eos_token": {"content": "<eot>"}})


def test_unreadable_tokenizer_json_raises_checkpoint_error_naming_the_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_hf_files(bad)
    assert info.value.file == str(bad)
    with pytest.raises(CheckpointError, match="missing.json"):
        Tokenizer.from_hf_files(tmp_path / "missing.json")


def test_post_processor_that_adds_more_than_bos_is_rejected(tmp_path):
    spec = json.loads((STORIES_HF / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"]["single"].insert(0, {"SpecialToken": {"id": "</s>", "type_id": 0}})
    spec["post_processor"]["special_tokens"]["</s>"] = {"id": "</s>", "ids": [2], "tokens": ["</s>"]}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"adds ids \[2, 1\] before the text"):
        Tokenizer.from_hf_files(path)


def test_decode_rejects_ids_outside_the_vocabulary(stories_hf):
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        stories_hf.decode([410, 512])


# -- GGUF and tokenizer.json of the same model agree -------------------------------------------


def _assert_paths_agree(hf: Tokenizer, gg: Tokenizer, text: str) -> None:
    for parse_special in (False, True):
        ids = hf.encode(text, parse_special=parse_special)
        assert ids == gg.encode(text, parse_special=parse_special), (text, parse_special)
        for skip in (False, True):
            assert hf.decode(ids, skip_special_tokens=skip) == gg.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_gguf_and_tokenizer_json_agree_on_fixed_strings(stories_hf, stories_gguf, text):
    _assert_paths_agree(stories_hf, stories_gguf, text)


@HYPOTHESIS
@given(text=texts)
def test_gguf_and_tokenizer_json_agree_on_generated_strings(stories_hf, stories_gguf, text):
    _assert_paths_agree(stories_hf, stories_gguf, text)


# -- parity with HF transformers ---------------------------------------------------------------


def _transformers_ids(tf, text: str) -> list[int]:
    """transformers' ids for ``text`` *as the tokenizer.json specifies it*.

    transformers 5.x rebuilds LlamaTokenizer's pipeline with a Metaspace pre-tokenizer
    (prepend_scheme "always") instead of the file's Prepend normalizer; Metaspace skips the
    dummy-prefix "▁" when the text already starts with a space or "▁", where SentencePiece,
    llama.cpp and the tokenizer.json itself add it. Adding that space explicitly gives
    transformers the same input as the others.
    """
    if text.startswith((" ", "\u2581")):
        text = " " + text
    return tf.encode(text)


def _assert_matches_transformers(tok: Tokenizer, tf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == _transformers_ids(tf, text), text
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == tf.decode(ids, skip_special_tokens=skip)


def test_transformers_5_drops_the_dummy_prefix_before_a_leading_space(stories_hf, stories_transformers):
    # Pins the known transformers 5.x difference; llama.cpp's vectors (test_gguf_vocab) show the
    # reference behaviour: " Hello" → ["▁", "▁Hello"].
    assert stories_hf.encode(" Zoo") == [1, 410, 410, 469, 347]
    # If this starts failing, transformers follows the file again: drop the workaround in
    # _transformers_ids.
    assert stories_transformers.encode(" Zoo") == [1, 410, 469, 347]


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_tokenizer_json_matches_transformers_on_fixed_strings(stories_hf, stories_transformers, text):
    _assert_matches_transformers(stories_hf, stories_transformers, text)


@HYPOTHESIS
@given(text=texts)
def test_tokenizer_json_matches_transformers_on_generated_strings(stories_hf, stories_transformers, text):
    _assert_matches_transformers(stories_hf, stories_transformers, text)


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 511), max_size=40))
def test_decode_matches_transformers_on_arbitrary_ids(stories_hf, stories_transformers, ids):
    for skip in (True, False):
        assert (stories_hf.decode(ids, skip_special_tokens=skip)
                == stories_transformers.decode(ids, skip_special_tokens=skip))
