"""The OpenAI shapes of logprobs, from the Request JSON's (:func:`zllm.spec.request.make_logprobs`).

Values are natural logs of the raw model distribution, floored at ``-9999.0`` so ``-inf``
stays valid JSON (:mod:`zllm.runtime.sampler`). A token's text is the tokenizer's decoding
of that one token, so a token that holds part of a multi-byte character reads as U+FFFD;
chat's ``bytes`` are that text's UTF-8 bytes.
"""

from __future__ import annotations

from typing import Any


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat Completions ``choices[].logprobs``: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(e["token"], e["logprob"]),
                         "top_logprobs": [one(t["token"], t["logprob"]) for t in e["top_logprobs"]]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]], text_offset: int = 0,
                        prompt: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Completions ``choices[].logprobs``: ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``, one entry per token, ``top_logprobs`` a ``{token text: logprob}`` map
    (two tokens with one text keep the likelier, as the map can hold only one). A token's
    ``text_offset`` is the summed length of the token texts before it (as vLLM counts), which
    can differ from its place in ``text`` where one token's text alone differs from its
    text in context (a SentencePiece word-start space).

    Args:
        entries: the generated tokens' logprobs.
        text_offset: the summed token-text length before the first entry (a stream's
            earlier chunks).
        prompt: with ``echo``, the prompt tokens' entries first: ``logprob`` None for the
            first prompt token (nothing predicts it) and its ``top_logprobs`` None.
    """
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in [*(prompt or ()), *entries]:
        tokens.append(e["token"])
        values.append(e["logprob"])
        tops.append(None if e["top_logprobs"] is None else
                    {t["token"]: t["logprob"] for t in reversed(e["top_logprobs"])})  # reversed: the likelier wins
        offsets.append(text_offset)
        text_offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
