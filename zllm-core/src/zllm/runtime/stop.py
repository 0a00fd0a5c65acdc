"""Stop rules: stop strings matched across token boundaries, never leaked to the output.

Text arrives as detokenized deltas. A tail that could still grow into a stop string is held
back until it cannot (or until the sequence ends), so a streamed client never sees part of
a stop string. The matcher remembers which stop string it cut at: the text it saw holds it,
while decoding the output's tokens afresh may not (a SentencePiece decode drops the leading
space of the first token, so a stop string starting with that space is not in it).
"""

from __future__ import annotations


class StopStringMatcher:
    """Releases text safely while watching for stop strings.

    Args:
        stops: the stop strings (non-empty).

    Attributes:
        matched: the stop string that ended the text, None until one did. Of stop strings
            found at once, the one that starts first; of those, the longest.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return ``(text safe to release, stopped)``.

        When a stop string appears the released text ends right before its earliest
        occurrence and ``stopped`` is True; nothing after it is ever released.
        """
        text = self._pending + delta
        if not self.stops:
            self._pending = ""
            return text, False
        hits = [(i, -len(s), s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            start, _, self.matched = min(hits)
            self._pending = ""
            return text[:start], True
        hold = self._held_suffix_len(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Release what was held back (the sequence ended for another reason)."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
