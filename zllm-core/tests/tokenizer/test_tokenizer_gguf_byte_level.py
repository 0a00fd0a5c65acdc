"""Byte-level BPE GGUFs written from real HF tokenizers the way llama.cpp's converter writes
them (Meta's Llama 3, DeepSeek): zllm reproduces llama.cpp's ``llama-bpe`` vectors and the
``tokenizers`` library on the HF file, streams text that round-trips, and renders the GGUF's
chat template as transformers does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokdata import FRAGMENTS, read_vocab_vectors, texts

from zllm.tokenizer import IncrementalDetokenizer, Tokenizer, render_chat, render_chat_text
from zllm.tokenizer.bpe_pre import BPE_PRE_TYPES, BPE_PRE_TYPES_BY_NAME
from zllm.tokenizer.gguf_vocab import EOG_TOKEN_TEXTS

LLAMA_BPE_VECTORS = read_vocab_vectors("llama-bpe")
# The one llama-bpe case whose ids depend on ignore_merges: "Việt" is a Llama-3 token that
# the merges alone do not build.
MERGES_DECIDE = 43

fixture_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Text with the material byte-level regexes treat differently: digit runs, contractions in any
# case, CJK and kana, punctuation runs, whitespace before newlines, special-token text.
byte_level_texts = st.one_of(
    texts,
    st.lists(
        st.sampled_from(
            FRAGMENTS
            + [
                "1234567",
                "3.14",
                "'S",
                "'ll",
                "I'VE",
                "日本語のテキスト",
                "한국어",
                "!!!",
                "...",
                "  \n",
                " \t\n",
                "<|eot_id|>",
                "<|begin_of_text|>",
                "<｜end▁of▁sentence｜>",
                "Ω",
                "ὼ",
                "ǅ",
            ]
        ),
        max_size=16,
    ).map("".join),
)


def _reference_ids(reference, text: str, parse_special: bool) -> list[int]:
    reference.encode_special_tokens = not parse_special
    return reference.encode(text, add_special_tokens=False).ids


def test_llama_bpe_vector_file_holds_46_cases():
    assert len(LLAMA_BPE_VECTORS) == 46 and ("", []) in LLAMA_BPE_VECTORS


@pytest.mark.parametrize(("text", "expected"), LLAMA_BPE_VECTORS, ids=range(len(LLAMA_BPE_VECTORS)))
def test_llama3_gguf_reproduces_llama_cpp_llama_bpe_vectors(llama3_gguf, text, expected):
    assert llama3_gguf.encode(text, add_special_tokens=False) == expected
    assert llama3_gguf.decode(expected) == text


@fixture_settings
@given(text=byte_level_texts, parse_special=st.booleans())
def test_llama3_gguf_matches_tokenizers_on_the_hf_file(
    llama3_gguf, llama3_reference, text, parse_special
):
    ids = llama3_gguf.encode(text, add_special_tokens=False, parse_special=parse_special)
    assert ids == _reference_ids(llama3_reference, text, parse_special)
    assert llama3_gguf.decode(ids, skip_special_tokens=False) == text


def test_llama_bpe_flags_follow_llama_cpp(llama3_gguf):
    # llama-bpe: add_bos and ignore_merges; the file has no add_bos key.
    assert llama3_gguf.add_bos and not llama3_gguf.add_eos
    assert llama3_gguf.bos_token == "<|begin_of_text|>" and llama3_gguf.eos_token == "<|eot_id|>"
    assert llama3_gguf.encode("Hello") == [128000, 9906]
    assert llama3_gguf.vocab_size == 128256


def test_end_of_generation_ids_are_eos_then_llama_cpp_eog_texts(llama3_gguf):
    eog = llama3_gguf.eos_token_ids
    assert eog[0] == llama3_gguf.token_to_id("<|eot_id|>")
    assert {llama3_gguf.id_to_token(i) for i in eog} == {"<|eot_id|>", "<|end_of_text|>"} | (
        {"<|eom_id|>"} & set(llama3_gguf.special_token_texts)
    )
    assert all(llama3_gguf.id_to_token(i) in EOG_TOKEN_TEXTS for i in eog)


def test_smaug_bpe_runs_merges_on_pieces_llama_bpe_takes_whole(llama3_meta):
    # The converter's hash table names this file smaug-bpe: llama-bpe's regex without
    # ignore_merges and without add_bos. Every vector but one agrees with the merges alone.
    smaug = Tokenizer.from_gguf_metadata(
        {**llama3_meta, "tokenizer.ggml.pre": "smaug-bpe"}, "smaug.gguf"
    )
    assert not smaug.add_bos
    for i, (text, expected) in enumerate(LLAMA_BPE_VECTORS):
        ids = smaug.encode(text, add_special_tokens=False)
        assert (ids == expected) == (i != MERGES_DECIDE), (i, text)
        assert smaug.decode(ids) == text
    text, expected = LLAMA_BPE_VECTORS[MERGES_DECIDE]
    assert [smaug.id_to_token(i) for i in smaug.encode(text, add_special_tokens=False)][-3:] == [
        "ĠVi",
        "á»ĩ",
        "t",
    ]


@pytest.mark.parametrize("pre", ["deepseek-v3", "joyai-llm"])
def test_deepseek_gguf_matches_tokenizers_on_the_vectors_inputs(
    deepseek_meta, deepseek_reference, pre
):
    tok = Tokenizer.from_gguf_metadata({**deepseek_meta, "tokenizer.ggml.pre": pre}, f"{pre}.gguf")
    for text, _ in LLAMA_BPE_VECTORS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == _reference_ids(deepseek_reference, text, parse_special=False), text
        assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def deepseek_gguf(deepseek_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(deepseek_meta, "deepseek.gguf")


@fixture_settings
@given(text=byte_level_texts, parse_special=st.booleans())
def test_deepseek_gguf_matches_tokenizers_on_generated_text(
    deepseek_gguf, deepseek_reference, text, parse_special
):
    ids = deepseek_gguf.encode(text, add_special_tokens=False, parse_special=parse_special)
    assert ids == _reference_ids(deepseek_reference, text, parse_special)
    assert deepseek_gguf.decode(ids, skip_special_tokens=False) == text


def test_deepseek_flags_come_from_its_tokenizer_config(deepseek_gguf):
    # tokenizer_config.json says add_bos_token false; SpecialVocab writes it to the file.
    assert not deepseek_gguf.add_bos
    assert deepseek_gguf.bos_token == "<｜begin▁of▁sentence｜>"
    assert deepseek_gguf.eos_token_ids[0] == deepseek_gguf.token_to_id("<｜end▁of▁sentence｜>")


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=byte_level_texts, prompt=st.sampled_from(["", "Once upon a time", "中文"]))
def test_streamed_text_equals_the_full_decode_and_round_trips(llama3_gguf, text, prompt):
    # Byte-level tokens split characters (emoji, CJK) across ids: deltas hold back partial UTF-8.
    prompt_ids = llama3_gguf.encode(prompt, add_special_tokens=False)
    ids = llama3_gguf.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama3_gguf, prompt_ids)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_a_byte_token_alone_is_held_back_until_the_character_completes(llama3_gguf):
    ids = llama3_gguf.encode("🦙", add_special_tokens=False)
    assert len(ids) > 1  # the llama emoji is not one Llama-3 token
    detok = IncrementalDetokenizer(llama3_gguf)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦙"]


@pytest.mark.parametrize("pre_type", BPE_PRE_TYPES, ids=lambda t: t.names[0])
def test_every_declared_pre_type_builds_a_lossless_tokenizer(llama3_meta, pre_type):
    tok = Tokenizer.from_gguf_metadata(
        {**llama3_meta, "tokenizer.ggml.pre": pre_type.names[0]}, "x.gguf"
    )
    text = "".join(FRAGMENTS) + " 1234567 I'VE 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.add_bos == pre_type.add_bos


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("default", "x 3333 (a)", ["x", "Ġ", "333", "3", "Ġ", "(", "a", ")"]),
        ("falcon", "a`b 1234", ["a", "`", "b", "Ġ", "123", "4"]),
        ("starcoder", "v12 it's", ["v", "1", "2", "Ġit", "'s"]),
        ("qwen2", "x 123\n\n", ["x", "Ġ", "1", "2", "3", "ĊĊ"]),
        ("llama-bpe", "x 12345 IT'S", ["x", "Ġ", "123", "45", "ĠIT", "'S"]),
        ("deepseek-v3", "1234日本語abc", ["123", "4", "æĹ¥æľ¬èªŀ", "abc"]),
        ("deepseek-coder", "a1.b", ["a", "1", ".", "b"]),
        ("bloom", "Hi, you.", ["Hi", ",", "Ġyou", "."]),
        ("tekken", "HelloWorld", ["Hello", "World"]),
        ("gpt-4o", "HelloWorld's", ["Hello", "World's"]),
    ],
)
def test_pre_type_regexes_split_as_declared(llama3_meta, pre, text, pieces):
    # The pieces each table entry's regexes cut (before BPE), in GPT-2's byte alphabet.
    tok = Tokenizer.from_gguf_metadata({**llama3_meta, "tokenizer.ggml.pre": pre}, "x.gguf")
    assert [p for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_vector_verified_types_are_the_ones_tests_check():
    verified = {name for t in BPE_PRE_TYPES if t.verified_by for name in t.names}
    assert {"llama-bpe", "llama3", "deepseek-v3", "joyai-llm", "gpt-2", "mpt"} <= verified
    assert (
        "smaug-bpe" not in verified
    )  # see test_smaug_bpe_runs_merges_on_pieces_llama_bpe_takes_whole
    assert BPE_PRE_TYPES_BY_NAME["llama-bpe"] is BPE_PRE_TYPES_BY_NAME["llama3"]


# -- the chat template inside the GGUF ------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! How are you?"}],
    [{"role": "system", "content": " You are a cat. "}, {"role": "user", "content": "Hi 🦙 中文"}],
    [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": "there was a little girl named Lily."},
        {"role": "user", "content": '\n\nok? <b>&</b> "q" I\'VE 1234'},
    ],
]


@pytest.fixture(scope="module")
def llama3_transformers(llama3_hf_dir):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(llama3_hf_dir), local_files_only=True)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_gguf_chat_template_renders_as_transformers_does(llama3_gguf, llama3_transformers, conv):
    messages = CONVERSATIONS[conv]
    assert llama3_gguf.chat_template == llama3_transformers.chat_template
    expected = llama3_transformers.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert render_chat_text(llama3_gguf, messages) == expected
    out = llama3_transformers.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    expected_ids = list(out["input_ids"] if "input_ids" in out else out)
    ids = render_chat(llama3_gguf, messages)
    assert ids == expected_ids
    assert ids.count(llama3_gguf.bos_token_id) == 1  # the template's BOS, not doubled by add_bos


def test_harmony_end_marker_is_not_end_of_generation_and_its_markers_render(llama3_meta):
    # A vocabulary with gpt-oss's <|return|> and <|call|>: llama.cpp drops <|end|> from the
    # end-of-generation set and makes it and the <|channel|> marker user-defined (always split
    # out and rendered).
    tokens = list(llama3_meta["tokenizer.ggml.tokens"])
    reserved = [i for i, t in enumerate(tokens) if t.startswith("<|reserved_special_token_")][:4]
    for i, text in zip(reserved, ["<|return|>", "<|call|>", "<|end|>", "<|channel|>"], strict=True):
        tokens[i] = text
    tok = Tokenizer.from_gguf_metadata({**llama3_meta, "tokenizer.ggml.tokens": tokens}, "h.gguf")
    ret, call, end, channel = reserved
    assert {ret, call} <= set(tok.eos_token_ids) and end not in tok.eos_token_ids
    assert tok.encode("a<|end|>b<|channel|>", add_special_tokens=False)[1::2] == [end, channel]
    assert tok.encode("<|return|>", add_special_tokens=False) != [ret]  # control: text
    assert tok.decode([end, channel, ret]) == "<|end|><|channel|>"


def test_docs_table_lists_every_declared_type_with_its_flags():
    docs_md = Path(__file__).resolve().parents[3] / "docs" / "gguf-tokenizers.md"
    docs = docs_md.read_text(encoding="utf-8")

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    for t in BPE_PRE_TYPES:
        names = ", ".join(f"`{n}`" for n in t.names)
        row = (
            f"| {names} | `{t.llama_cpp_type}` | {len(t.regexes)} | {yes(t.ignore_merges)} | "
            f"{yes(t.add_bos)} | {yes(t.clean_spaces)} | {t.verified_by or 'table only'} |"
        )
        assert row in docs, row
