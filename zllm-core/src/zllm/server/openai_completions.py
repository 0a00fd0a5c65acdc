"""``POST /v1/completions`` — OpenAI Completions (legacy text completion).

https://platform.openai.com/docs/api-reference/completions. ``n`` > 1 runs n engine requests
at once (:func:`zllm.server.common.choice_requests`); ``response_format`` (vLLM accepts it
here too) reaches the engine as on Chat. Field table: docs/server.md.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request

from zllm.runtime.kv_cache import OutOfKVBlocks
from zllm.runtime.sampler import prompt_logprobs
from zllm.server.common import (
    SamplingFields,
    ServerState,
    StrictModel,
    choice_requests,
    new_id,
    openai_usage,
    reject_if,
    sse,
    sse_response,
    state,
)
from zllm.server.errors import ApiError
from zllm.server.generation import merged_events, open_streams, run_all_to_end
from zllm.server.logprobs import completion_logprobs
from zllm.spec.request import make_logprobs

router = APIRouter()


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted and ignored: zllm adds no padding


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    """A 400 for ``stream_options`` on a request that does not stream, as OpenAI and vLLM answer.

    Raises:
        ApiError: 400, param ``stream_options``.
    """
    if options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options",
                       code="invalid_value")


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or a list of token ids; a list of one string / one id list also works")
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # vLLM's extension: Chat's shape, enforced by the engine
    user: str | None = None  # accepted and ignored


# Engine field -> this protocol's field, for error messages.
RENAMES = {"prompt_token_ids": "prompt"}


def engine_request(body: CompletionRequest) -> dict[str, Any]:
    check_stream_options(body.stream, body.stream_options)
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of: only best_of = 1 is supported", param="best_of", code="unsupported_parameter")
    reject_if(body.logit_bias, "logit_bias")
    reject_if(body.suffix, "suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: batches of prompts are not supported (got {len(prompt)}); "
                           "send one string or one list of token ids per request", param="prompt",
                           code="unsupported_parameter")
        prompt = prompt[0]
    req = body.engine_fields()
    if isinstance(prompt, str):
        req["prompt"] = prompt
    else:
        if not prompt:
            raise ApiError(400, "prompt: the list of token ids is empty", param="prompt", code="invalid_value")
        req["prompt_token_ids"] = prompt
    if body.max_tokens is not None:
        req["max_tokens"] = body.max_tokens
    if body.stop is not None:
        req["stop"] = body.stop
    if body.logprobs is not None:
        req["logprobs"] = body.logprobs
    if body.response_format is not None:
        req["response_format"] = body.response_format
    return req


async def _echo(st: ServerState, req: dict[str, Any],
                body: CompletionRequest) -> tuple[str, list[dict[str, Any]] | None]:
    """``echo``: the prompt's text (the prompt string as sent, or the decoded token ids) and,
    with ``logprobs``, its tokens' entries — the first token's logprob and top_logprobs null,
    the others from one forward over the prompt (:meth:`zllm.Engine.prompt_logits`)."""
    engine = st.engine

    def compute() -> tuple[str, list[dict[str, Any]] | None]:
        parsed = engine.parse(req)
        ids = engine.prompt_ids(parsed)
        text = parsed.prompt if parsed.prompt is not None else engine.tokenizer.decode(ids, skip_special_tokens=False)
        if body.logprobs is None:
            return text, None
        try:
            logits = engine.prompt_logits(ids)
        except OutOfKVBlocks as exc:
            raise ApiError(503, f"echo: the KV cache has no room to score the prompt now ({exc}); retry later",
                           param="echo", code="server_busy") from None
        rest = make_logprobs(prompt_logprobs(logits, ids, body.logprobs), engine.token_text)
        first = {"token_id": ids[0], "token": engine.token_text(ids[0]), "logprob": None, "top_logprobs": None}
        return text, [first, *rest]

    return await anyio.to_thread.run_sync(compute)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    req = engine_request(body)
    streams = await open_streams(st, request, choice_requests(req, body.n, st.engine.config.generation.seed),
                                 RENAMES)
    cid, created = new_id("cmpl-"), int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, with_usage_key: bool = False):
        out = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
               "choices": choices}
        if with_usage_key:
            out["usage"] = usage
        return out

    try:
        echo_text, echo_logprobs = await _echo(st, req, body) if body.echo else ("", None)
    except BaseException:
        for stream in streams:
            await stream.aclose()  # free the queued requests: the error answers them
        raise

    if not body.stream:
        results = await run_all_to_end(streams, request)
        return chunk([{"index": i, "text": echo_text + text, "finish_reason": final["finish_reason"],
                       "logprobs": None if final["logprobs"] is None else
                       completion_logprobs(final["logprobs"], 0, echo_logprobs)}
                      for i, (text, final) in enumerate(results)],
                     openai_usage([final for _, final in results]), True)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events():
        echo_offset = sum(len(e["token"]) for e in echo_logprobs or ())
        offsets = [echo_offset] * len(streams)
        if body.echo:
            logprobs = None if body.logprobs is None else completion_logprobs([], 0, echo_logprobs)
            for i in range(len(streams)):
                yield sse(chunk([{"index": i, "text": echo_text, "finish_reason": None, "logprobs": logprobs}],
                                None, include_usage))
        finals: list[dict[str, Any]] = [{} for _ in streams]
        async with aclosing(merged_events(streams)) as merged:
            async for i, event in merged:
                if event["type"] == "delta":
                    if event["text"] or event["logprobs"]:
                        logprobs = None if event["logprobs"] is None else \
                            completion_logprobs(event["logprobs"], offsets[i])
                        yield sse(chunk([{"index": i, "text": event["text"], "finish_reason": None,
                                          "logprobs": logprobs}], None, include_usage))
                        offsets[i] += sum(len(e["token"]) for e in event["logprobs"] or ())
                    continue
                finals[i] = event
                yield sse(chunk([{"index": i, "text": "", "finish_reason": event["finish_reason"],
                                  "logprobs": None}], None, include_usage))
        if include_usage:
            yield sse(chunk([], openai_usage(finals), True))
        yield sse("[DONE]")

    return sse_response(events(), streams)
