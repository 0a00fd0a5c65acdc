"""The stop-string matcher: text split into any deltas releases exactly the text before the
first stop string, never part of one, and the matcher names the stop string it cut at."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from zllm.runtime.stop import StopStringMatcher

# A small alphabet with a space makes stop strings occur often and overlap each other.
TEXT = st.text(alphabet="ab ", max_size=24)
STOPS = st.lists(st.text(alphabet="ab ", min_size=1, max_size=4), min_size=1, max_size=4)


def _bounds(text: str, cuts: list[int]) -> list[int]:
    return [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]


def _first_stop(text: str, stops: list[str], bounds: list[int]) -> tuple[int, str] | None:
    """Where a reader of ``text`` arriving in the pieces between ``bounds`` stops: at the
    first piece after which the text so far holds a stop string, at the one starting first
    (of those, the longest)."""
    for end in bounds[1:]:
        found = [(i, -len(s), s) for s in stops if (i := text[:end].find(s)) >= 0]
        if found:
            start, _, stop = min(found)
            return start, stop
    return None


def _feed(matcher: StopStringMatcher, text: str, bounds: list[int]) -> tuple[str, bool]:
    """Feed ``text`` in the pieces between ``bounds``; return (released text, stopped)."""
    released: list[str] = []
    for a, b in itertools.pairwise(bounds):
        out, stopped = matcher.feed(text[a:b])
        released.append(out)
        if stopped:
            return "".join(released), True
    released.append(matcher.flush())
    return "".join(released), False


@settings(max_examples=300, deadline=None)
@given(text=TEXT, stops=STOPS, cuts=st.lists(st.integers(0, 30), max_size=8))
def test_releases_the_text_before_the_first_stop_and_names_that_stop(text, stops, cuts):
    matcher = StopStringMatcher(tuple(stops))
    bounds = _bounds(text, cuts)
    out, stopped = _feed(matcher, text, bounds)
    first = _first_stop(text, stops, bounds)
    if first is None:
        assert (out, stopped, matcher.matched) == (text, False, None)
    else:
        start, stop = first
        assert (out, stopped, matcher.matched) == (text[:start], True, stop)


def test_a_stop_string_that_begins_with_a_leading_space_is_named():
    # A SentencePiece vocabulary's first generated token "▁the" arrives as " the".
    matcher = StopStringMatcher((" the", "zzz"))
    assert matcher.feed(" the") == ("", True)
    assert matcher.matched == " the"


def test_of_stop_strings_starting_at_one_place_the_longest_is_named():
    matcher = StopStringMatcher((" th", " the"))
    assert matcher.feed("x the") == ("x", True)
    assert matcher.matched == " the"


def test_no_stop_string_matched_when_the_text_ends_without_one():
    matcher = StopStringMatcher((" the",))
    assert matcher.feed("a th") == ("a", False)
    assert matcher.flush() == " th"
    assert matcher.matched is None
