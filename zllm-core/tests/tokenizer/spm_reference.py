"""A direct Python transcription of llama.cpp's SentencePiece tokenizer, as a test oracle.

Source: llama.cpp ``src/llama-vocab.cpp``, ``llm_tokenizer_spm_session::tokenize`` and
``resegment`` (with ``llm_bigram_spm``'s ordering: highest score first, then leftmost). It works
on raw fragment text without special-token partitioning, so callers pass text that holds none.
"""

from __future__ import annotations

import heapq


def spm_tokenize(text: str, vocab: dict[str, int], scores: list[float], add_space_prefix: bool = True) -> list[int]:
    """Token ids of one raw-text fragment, exactly as llama.cpp's SPM tokenizer produces them."""
    if not text:
        return []
    if add_space_prefix:
        text = " " + text
    text = text.replace(" ", "\u2581")
    # Symbols: one per character, doubly linked; n == 0 marks a symbol merged into its left.
    sym_text = list(text)
    prev = list(range(-1, len(text) - 1))
    nxt = list(range(1, len(text) + 1))
    nxt[-1] = -1
    alive = [True] * len(text)
    queue: list[tuple[float, int, int, str]] = []

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        merged = sym_text[left] + sym_text[right]
        tid = vocab.get(merged)
        if tid is not None:
            heapq.heappush(queue, (-scores[tid], left, right, merged))

    for i in range(1, len(text)):
        try_add_bigram(i - 1, i)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if not (alive[left] and alive[right]) or sym_text[left] + sym_text[right] != merged:
            continue  # outdated: one side was merged since
        sym_text[left] = merged
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        try_add_bigram(prev[left], left)
        try_add_bigram(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        piece = sym_text[i]
        if piece in vocab:
            out.append(vocab[piece])
        else:  # only unmerged single characters get here: byte fallback
            out.extend(vocab[f"<0x{b:02X}>"] for b in piece.encode("utf-8"))
        i = nxt[i]
    return out
