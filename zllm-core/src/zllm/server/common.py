"""What every protocol module shares: the server state, the sampling fields that map 1:1
onto the Request JSON, model-name checks, ids and server-sent events."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_validator
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from zllm.server.errors import ANTHROPIC_PATHS, ApiError, error_body
from zllm.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from zllm.server.generation import EngineStream
    from zllm.server.openai_responses import ResponseStore

log = logging.getLogger(__name__)


class ServerState:
    """The engine behind the app and what the routes report about it.

    Attributes:
        shutdown_deadline: :func:`time.monotonic` time at which a shutdown ends what is
            left, or None while serving.
        responses: stored ``/v1/responses`` results (set by the app factory).
    """

    responses: ResponseStore

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self.shutdown_deadline: float | None = None

    def begin_shutdown(self, timeout_s: float) -> None:
        """Give every request, queued or running, at most ``timeout_s`` more seconds: the
        engine drops what is left then, and the routes answer it 503 (or a last ``error``
        event) with ``x-should-retry: false``."""
        self.shutdown_deadline = time.monotonic() + timeout_s
        self.engine.drain(self.shutdown_deadline)

    def check_model(self, model: str | None) -> None:
        """Raises ApiError 404 unless ``model`` is the served name (None = the served model)."""
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def state(request: Request) -> ServerState:
    return request.app.state.zllm


class StrictModel(BaseModel):
    """Request bodies: JSON types are not coerced (``"1"`` is not a number, ``true`` is not
    1) and unknown fields are a 400 naming the field."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # JSON can spell a lone UTF-16 surrogate ("\\ud800") that is no Unicode text: the
        # tokenizer cannot take it and a response echoing it cannot be encoded as UTF-8.
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text holds an unpaired UTF-16 surrogate ({value[exc.start]!a} at index "
                             f"{exc.start}), which is not Unicode text; send valid UTF-8") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class SamplingFields(StrictModel):
    """Fields passed to the engine unchanged. The last five are zllm/vLLM extensions
    (send them with the SDKs' ``extra_body``)."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None

    def engine_fields(self) -> dict[str, Any]:
        names = SamplingFields.model_fields
        return {k: v for k, v in self.model_dump(include=set(names)).items() if v is not None}


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def reject_if(value: Any, field: str, why: str = "") -> None:
    """400 naming ``field`` when a generation-changing field is set to something zllm does
    not implement (``None``/``False``/empty mean "not asked for")."""
    from zllm.server.errors import unsupported

    if value not in (None, False) and value != [] and value != {}:
        raise unsupported(field, why)


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), allow_nan=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def sse_response(body: AsyncGenerator[str, None], streams: Sequence[EngineStream], *, anthropic: bool = False,
                 error_event: Callable[[ApiError], str] | None = None) -> StreamingResponse:
    """A ``text/event-stream`` response whose engine streams are closed however it ends.

    An error after the response has started cannot change its status any more; it is sent
    as a last event: ``error_event(err)`` when given (Responses numbers its events), else the
    protocol's error body (an ``event: error`` on Anthropic's routes, bare ``data:`` on
    OpenAI's). Errors that are not :class:`ApiError` are logged and reported as 500s.
    Once the response ends (a client disconnect included) ``body`` is closed, then every
    stream: closing ``body`` first lets it stop what it awaits on its streams' behalf."""

    async def guarded():
        async with aclosing(body):
            try:
                async for chunk in body:
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - reported to the client, then logged
                if isinstance(exc, ApiError):
                    err = exc
                else:
                    log.exception("error while streaming")
                    err = ApiError(500, f"generation failed: {type(exc).__name__}: {exc}")
                if error_event is not None:
                    yield error_event(err)
                else:
                    path = ANTHROPIC_PATHS[0] if anthropic else ""
                    yield sse(error_body(path, err), "error" if anthropic else None)

    chunks = guarded()

    async def close() -> None:
        await chunks.aclose()
        for stream in streams:
            await stream.aclose()

    return StreamingResponse(
        chunks, media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(close),
    )


def openai_usage(finals: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's ``usage`` object (Chat and Completions) from the engine's final events of a
    request's choices: completion tokens summed over them, the prompt counted once (as OpenAI
    counts ``n`` > 1; the choices share one prompt)."""
    u = finals[0]["usage"]
    completion = sum(f["usage"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": u["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


MAX_CHOICES = 16
"""The largest ``n`` (choices per request) the OpenAI routes accept."""


def choice_requests(req: dict[str, Any], n: int | None, default_seed: int | None) -> list[dict[str, Any]]:
    """The engine requests of ``n`` independent choices of one request ``req``: copies of it,
    choice ``i`` seeded with ``seed + i`` (modulo 2**64) when a seed is set, by the request or
    else by the config (``default_seed``: ``generation.seed``), so seeded choices differ from
    one another and each is reproducible.

    Raises:
        ApiError: 400 naming ``n`` unless it is None or 1..:data:`MAX_CHOICES`.
    """
    if n is None:
        n = 1
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n: expected an int from 1 to {MAX_CHOICES} (choices per request), got {n}",
                       param="n", code="invalid_value")
    seed = req.get("seed", default_seed)
    if n == 1 or seed is None:
        return [dict(req) for _ in range(n)]
    return [{**req, "seed": (seed + i) % 2**64} for i in range(n)]
