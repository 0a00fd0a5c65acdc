"""Incremental detokenization: turn a stream of generated ids into text deltas.

The prefix-offset method of vLLM (``detokenize_incrementally``) and HF ``TextStreamer``: decode
a short window of recent ids twice — up to the last emitted id (``prefix``) and up to the newest
id — and emit what the second decode adds. Decoding a window rather than single ids keeps the
context-dependent parts of decoding right (SentencePiece's ``▁`` becomes a space, and the
decoder strips one leading space only from the window's first token, in both decodes alike).

Text is held back while it could still change:

- the decoded tail ends in U+FFFD (a multi-byte character not complete yet), as vLLM does;
- the newest id is a ``<0xXX>`` byte-fallback token: the ``tokenizers`` ByteFallback decoder
  turns a *whole* run of byte tokens into U+FFFD when any byte of it is invalid, so a later byte
  can change text the run already decoded to.

With these rules the concatenation of all deltas plus :meth:`IncrementalDetokenizer.flush`
equals ``tokenizer.decode(output_ids)`` exactly, and a delta holds U+FFFD only where the full
decode does. Cost per step is O(window): the ids since the last emission plus those of the
emission before.
"""

from __future__ import annotations

from collections.abc import Iterable

from zllm.tokenizer.tokenizer import Tokenizer

# Prompt ids that seed the window (vLLM uses 5): enough context for the first output token's
# leading space and for merges with the prompt's last characters.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one generated sequence: :meth:`push` each step's ids, :meth:`flush` at the end.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt, if output continues it: then the first output token renders
            as it does after the prompt (e.g. ``▁Hello`` → ``" Hello"``), and the deltas add up
            to ``decode(prompt + output)`` minus its common prefix with ``decode(prompt)``.
            Without a prompt, or with one of skipped special tokens only, they add up to
            ``decode(output)``.
        skip_special_tokens: drop special tokens, as ``Tokenizer.decode`` does.
        keep_special_ids: special tokens kept as text all the same (a chat format's markers,
            such as ``[TOOL_CALLS]``, which its output parser reads).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True,
                 keep_special_ids: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._special = tokenizer.special_token_ids - keep_special_ids if skip_special_tokens else frozenset()
        self._bytes = tokenizer.byte_fallback_ids
        context = self._kept(prompt_ids or [])
        start = max(0, len(context) - PROMPT_CONTEXT_TOKENS)
        # Start the window after a non-byte token, so no byte run is cut in two by it.
        while start > 0 and context[start - 1] in self._bytes:
            start -= 1
        # The window: ids[:read_offset] were emitted (the prefix), the rest are pending.
        self._ids: list[int] = context[start:]
        self._read_offset = len(self._ids)

    def _kept(self, ids: Iterable[int]) -> list[int]:
        # Dropping special ids before windowing (instead of decoding them with skip=True) keeps
        # a window's first token a real one, whose leading space is stripped in both decodes.
        return [i for i in ids if i not in self._special]

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (possibly ``""``).

        Raises:
            ValueError: an id is outside the vocabulary.
        """
        self._ids.extend(self._kept(token_ids))
        if self._ids and self._ids[-1] in self._bytes:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """Return all held-back text (an incomplete character decodes to U+FFFD). Call once,
        when the sequence has ended."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            # Nothing pending; moving the window now would leave it without a prefix.
            return ""
        prefix_text = self._tok.decode(self._ids[: self._read_offset], skip_special_tokens=False)
        new_text = self._tok.decode(self._ids, skip_special_tokens=False)
        if not final and new_text.endswith("\ufffd"):
            return ""
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text) :]
        else:
            # Only when the prompt context ends inside a byte run that the output continues.
            common = 0
            for a, b in zip(prefix_text, new_text, strict=True):
                if a != b:
                    break
                common += 1
            delta = new_text[common:]
        # The ids just emitted are the next step's prefix; older ones are no longer needed.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return delta
