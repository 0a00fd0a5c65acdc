"""``POST /v1/completions`` — OpenAI Completions (legacy text completion).

https://platform.openai.com/docs/api-reference/completions. Field table: docs/server.md.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request

from zllm.server.common import SamplingFields, StrictModel, new_id, openai_usage, reject_if, sse, sse_response, state
from zllm.server.errors import ApiError
from zllm.server.generation import EngineStream, run_to_end

router = APIRouter()


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted and ignored: zllm adds no padding


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
    user: str | None = None  # accepted and ignored


# Engine field -> this protocol's field, for error messages.
RENAMES = {"prompt_token_ids": "prompt"}


def engine_request(body: CompletionRequest) -> dict[str, Any]:
    if body.n not in (None, 1):
        raise ApiError(400, "n: only n = 1 is supported", param="n", code="unsupported_parameter")
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of: only best_of = 1 is supported", param="best_of", code="unsupported_parameter")
    reject_if(body.echo, "echo")
    reject_if(body.logprobs, "logprobs")
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
    return req


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = state(request)
    st.check_model(body.model)
    stream = await EngineStream.open(st, request, engine_request(body), RENAMES)
    cid, created = new_id("cmpl-"), int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, with_usage_key: bool = False):
        out = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
               "choices": choices}
        if with_usage_key:
            out["usage"] = usage
        return out

    if not body.stream:
        text, final = await run_to_end(stream, request)
        return chunk([{"index": 0, "text": text, "finish_reason": final["finish_reason"], "logprobs": None}],
                     openai_usage(final), True)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events():
        async for event in stream.events():
            if event["type"] == "delta":
                if event["text"]:
                    yield sse(chunk([{"index": 0, "text": event["text"], "finish_reason": None, "logprobs": None}],
                                    None, include_usage))
                continue
            yield sse(chunk([{"index": 0, "text": "", "finish_reason": event["finish_reason"], "logprobs": None}],
                            None, include_usage))
            if include_usage:
                yield sse(chunk([], openai_usage(event), True))
        yield sse("[DONE]")

    return sse_response(events(), stream)
