"""IncrementalDetokenizer: streamed deltas add up to the full decode, never half a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokdata import texts

from zllm.tokenizer import IncrementalDetokenizer, Tokenizer

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
chunk_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=8)


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> tuple[list[str], str]:
    """Push ``ids`` in chunks of the given sizes (cycled); return the deltas and the flush."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        deltas.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    return deltas, detok.flush()


def assert_streams_exactly(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool = True) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas, rest = stream(tok, ids, chunks, skip_special_tokens=skip)
    emitted = ""
    for delta in deltas:
        emitted += delta
        # Every delta extends a prefix of the final text: nothing is emitted half, twice, or
        # as a U+FFFD that the full decode does not have at that place.
        assert full.startswith(emitted), (ids, deltas)
    assert emitted + rest == full


@HYPOTHESIS
@given(text=texts, chunks=chunk_sizes)
def test_deltas_add_up_to_full_decode_for_generated_text(stories_hf, text, chunks):
    ids = stories_hf.encode(text, add_special_tokens=False)
    assert_streams_exactly(stories_hf, ids, chunks)
    deltas, rest = stream(stories_hf, ids, chunks)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)
        if ids and ids[-1] not in stories_hf.byte_fallback_ids:
            assert rest == ""  # valid text is complete once a non-byte token ends it


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 511), max_size=40), chunks=chunk_sizes, skip=st.booleans())
def test_deltas_add_up_to_full_decode_for_random_ids(stories_hf, ids, chunks, skip):
    assert_streams_exactly(stories_hf, ids, chunks, skip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, chunks=chunk_sizes)
def test_deltas_add_up_to_full_decode_on_the_32000_token_vocab(llama_spm, text, chunks):
    assert_streams_exactly(llama_spm, llama_spm.encode(text), chunks)


def test_multibyte_character_is_held_until_complete(stories_hf):
    ids = stories_hf.encode("a🦙", add_special_tokens=False)  # "▁a" then four <0xXX> tokens
    assert len(ids) == 5
    detok = IncrementalDetokenizer(stories_hf)
    assert [detok.push([i]) for i in ids] == ["a", "", "", "", ""]
    # A byte run is final only once a non-byte token follows (a later byte could invalidate it).
    assert detok.push(stories_hf.encode("!", add_special_tokens=False)[-1:]) == "🦙!"
    assert detok.flush() == ""


def test_invalid_byte_run_is_emitted_as_the_full_decode_renders_it(stories_hf):
    b = stories_hf.token_to_id
    ids = [b("<0xE4>"), b("<0xB8>"), b("<0xAD>"), b("<0x80>"), b("\u2581the")]
    assert stories_hf.decode(ids[:3]) == "中"
    assert stories_hf.decode(ids) == "\ufffd" * 4 + " the"
    assert "".join(stream(stories_hf, ids, [1])[0]) == "\ufffd" * 4 + " the"


def test_unfinished_character_at_end_of_stream_is_flushed_as_replacement(stories_hf):
    ids = stories_hf.encode("ok🦙", add_special_tokens=False)[:-1]
    deltas, rest = stream(stories_hf, ids, [1])
    assert "".join(deltas) == "ok"
    assert rest == stories_hf.decode(ids)[2:] and set(rest) == {"\ufffd"}


def test_first_output_token_loses_its_leading_space_without_prompt(stories_hf):
    detok = IncrementalDetokenizer(stories_hf, prompt_ids=[1])  # only BOS: nothing to continue
    assert detok.push(stories_hf.encode("Once upon", add_special_tokens=False)) == "Once upon"


@pytest.mark.parametrize(("prompt", "output"), [("Once upon", " a time"), ("Zoo", "🦙 and 中文!"), ("Hi", "\n\nBye")])
def test_output_continues_the_prompt_text(stories_hf, prompt, output):
    prompt_ids = stories_hf.encode(prompt)
    out_ids = stories_hf.encode(prompt + output)[len(prompt_ids) :]
    assert stories_hf.encode(prompt + output)[: len(prompt_ids)] == prompt_ids
    detok = IncrementalDetokenizer(stories_hf, prompt_ids=prompt_ids)
    text = "".join(detok.push([i]) for i in out_ids) + detok.flush()
    assert text == output


def test_prompt_ending_inside_a_character_is_completed_by_the_output(stories_hf):
    ids = stories_hf.encode("Zoo🦙!")
    detok = IncrementalDetokenizer(stories_hf, prompt_ids=ids[:-3])  # prompt has 2 of 4 bytes
    assert "".join(detok.push([i]) for i in ids[-3:]) + detok.flush() == "🦙!"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_mid_stream_match_full_decode(stories_hf, skip):
    ids = stories_hf.encode("Zoo<s> Lily</s>\nOnce", parse_special=True) + [2, 1]
    assert_streams_exactly(stories_hf, ids, [1], skip)
    assert_streams_exactly(stories_hf, ids, [3], skip)


def test_each_step_decodes_a_bounded_window(stories_hf, monkeypatch):
    ids = stories_hf.encode("Once upon a time, there was a little girl named Lily. 🦙 " * 60)
    widths: list[int] = []
    decode = stories_hf.decode
    monkeypatch.setattr(stories_hf, "decode", lambda i, **kw: widths.append(len(i)) or decode(i, **kw))
    deltas, rest = stream(stories_hf, ids, [1])
    monkeypatch.undo()
    assert "".join(deltas) + rest == stories_hf.decode(ids)
    assert len(ids) > 1000 and max(widths) <= 10


# -- byte-level BPE: one character's bytes can spread over several tokens --------------------

byte_level_texts = st.one_of(
    texts,
    st.lists(st.sampled_from(["🦙", "😶\u200d🌫️", "🚀", "中文", "我想在", "天～", "ពិសេស", " ", "a", "\n", "é"]),
             max_size=12).map("".join),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=byte_level_texts, chunks=chunk_sizes)
def test_deltas_add_up_to_full_decode_on_byte_level_bpe(gpt2, text, chunks):
    ids = gpt2.encode(text, add_special_tokens=False)
    assert_streams_exactly(gpt2, ids, chunks)
    deltas, rest = stream(gpt2, ids, chunks)
    assert "".join(deltas) + rest == text  # lossless, and no U+FFFD from a half character
    assert not any("\ufffd" in d for d in deltas if "\ufffd" not in text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 50256), max_size=30), chunks=chunk_sizes)
def test_deltas_add_up_to_full_decode_for_random_byte_level_ids(gpt2, ids, chunks):
    assert_streams_exactly(gpt2, ids, chunks)


def test_byte_level_emoji_split_over_tokens_is_held_until_complete(gpt2):
    ids = gpt2.encode("🦙!", add_special_tokens=False)
    assert [gpt2.id_to_token(i) for i in ids] == ["ðŁ", "¦", "Ļ", "!"]  # F0 9F | A6 | 99 | !
    detok = IncrementalDetokenizer(gpt2)
    assert [detok.push([i]) for i in ids] == ["", "", "🦙", "!"]
    assert detok.flush() == ""
