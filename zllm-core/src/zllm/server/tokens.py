"""Token counting: ``POST /tokenize`` and ``POST /detokenize`` (vLLM's extensions, in OpenAI's
error shape), and the prompt rendering Anthropic's ``count_tokens`` shares with them.

A prompt is tokenized exactly as a generation request's would be (the engine's
:meth:`~zllm.Engine.parse` and :meth:`~zllm.Engine.prompt_ids`: the chat template with the
request's tools, BOS as the engine adds it), so a count is the ``prompt_tokens`` the same
request would report. Field table: docs/server.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
from fastapi import APIRouter
from starlette.requests import Request

from zllm.server.common import ServerState, StrictModel, state
from zllm.server.errors import ApiError
from zllm.server.generation import request_error
from zllm.server.openai_chat import ChatMessage, engine_messages
from zllm.spec.errors import RequestError
from zllm.tokenizer.chat import render_chat

router = APIRouter()


async def prompt_ids(st: ServerState, req: dict[str, Any], renames: Mapping[str, str], *,
                     add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids of engine request ``req``, computed off the event loop.

    Args:
        add_generation_prompt: for a ``messages`` prompt, end it with the template's
            generation prompt (as generation does); False renders the conversation alone.

    Raises:
        ApiError: 400 for a request the engine rejects, its field renamed by ``renames``.
    """
    engine = st.engine

    def compute() -> list[int]:
        parsed = engine.parse(req)
        if add_generation_prompt or parsed.messages is None:
            return engine.prompt_ids(parsed)
        return render_chat(engine.tokenizer, [m.to_dict() for m in parsed.messages], add_generation_prompt=False,
                           add_bos=parsed.add_bos, tools=parsed.tools or None)

    try:
        return await anyio.to_thread.run_sync(compute)
    except RequestError as exc:
        raise request_error(exc, renames) from exc


class TokenizeRequest(StrictModel):
    """vLLM's two forms: ``prompt`` (text), or ``messages`` (Chat's) with ``tools`` and
    ``add_generation_prompt``; ``add_special_tokens`` is the engine's ``add_bos``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def _tokenize_request(body: TokenizeRequest) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        got = "both were given" if body.prompt is not None else "neither was given"
        raise ApiError(400, f"prompt: give exactly one of prompt (a string) and messages; {got}", param="prompt",
                       code="invalid_value")
    req: dict[str, Any] = {}
    if body.prompt is not None:
        for field in ("tools", "add_generation_prompt"):
            if getattr(body, field) is not None:
                raise ApiError(400, f"{field}: applies to messages only, not to a prompt string", param=field,
                               code="invalid_value")
        req["prompt"] = body.prompt
    else:
        assert body.messages is not None
        req["messages"] = engine_messages(body.messages)
        if body.tools is not None:
            req["tools"] = body.tools
    if body.add_special_tokens is not None:
        req["add_special_tokens"] = body.add_special_tokens
    return req


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """``{"count", "max_model_len", "tokens"}`` (and ``token_strs``, each token's text, when
    ``return_token_strs``)."""
    st = state(request)
    st.check_model(body.model)
    ids = await prompt_ids(st, _tokenize_request(body), {}, add_generation_prompt=body.add_generation_prompt
                           is not False)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": st.engine.llm.context_length, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [st.engine.token_text(i) for i in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """``{"prompt"}``: the tokens' text, special tokens included (so it tokenizes back to them).

    Raises:
        ApiError: 400 naming ``tokens[i]`` for an id outside the vocabulary.
    """
    st = state(request)
    st.check_model(body.model)
    vocab_size = st.engine.tokenizer.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"tokens[{i}]: token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                           param=f"tokens[{i}]", code="invalid_value")
    text = await anyio.to_thread.run_sync(lambda: st.engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
    return {"prompt": text}
