"""Drive one engine stream from the event loop.

The engine is blocking (a step runs the model), so every call into it runs in a worker
thread (``anyio.to_thread``); the event loop keeps serving other clients. The engine's lock
serialises steps and one step advances every running sequence, so N streams driven from N
threads form one continuous batch.

Cancellation: when the client goes away, Starlette cancels the response task. anyio defers
that cancellation until the worker thread's current ``next()`` (at most one engine step)
returns; then :meth:`EngineStream.aclose` closes the engine's generator, which aborts the
sequence and frees its KV blocks — within one round. A request that outlives
``server.request_timeout_s`` is closed the same way and answered with a 408.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import anyio.to_thread

from zllm.server.errors import ApiError
from zllm.server.metrics import ServerMetrics
from zllm.spec.errors import RequestError, UnsupportedRequestError


def request_error(exc: RequestError, renames: Mapping[str, str]) -> ApiError:
    """A 400 for an engine RequestError, with the field renamed to the protocol's name."""
    field = renames.get(exc.field, exc.field)
    message = str(exc)
    if exc.field and message.startswith(exc.field + ":"):
        message = field + message[len(exc.field):]
    code = "unsupported_parameter" if isinstance(exc, UnsupportedRequestError) else "invalid_value"
    return ApiError(400, message, param=field or None, code=code)


class EngineStream:
    """One request's events (the Engine's ``delta`` events, then one ``final``).

    Build with :meth:`open`, which submits the request and waits for its first event, so
    request errors surface before a response starts.
    """

    def __init__(self, engine, metrics: ServerMetrics, t_received: float):
        self._engine, self._metrics = engine, metrics
        self._gen = None
        self._first: dict[str, Any] | None = None
        self._t_received = t_received
        timeout_s = engine.config.server.request_timeout_s
        self._deadline = None if timeout_s is None else t_received + timeout_s
        self._t_last_token: float | None = None
        self.final: dict[str, Any] | None = None
        self.prompt_tokens = 0
        self.token_ids: list[int] = []

    @classmethod
    async def open(cls, engine, metrics: ServerMetrics, request: dict[str, Any],
                   renames: Mapping[str, str]) -> EngineStream:
        """Submit ``request`` (the engine's Request JSON) and fetch its first event.

        Raises:
            ApiError: 400 for a request the engine rejects (named in the protocol's terms).
        """
        stream = cls(engine, metrics, time.perf_counter())

        def start() -> None:
            parsed = engine.parse(request)
            # Tokenized again by the engine on submit: the stream does not expose its
            # sequence, and Anthropic's message_start must report the prompt's length.
            stream.prompt_tokens = len(engine.prompt_ids(parsed))
            stream._gen = engine.generate_stream(parsed)
            stream._first = next(stream._gen)

        try:
            await anyio.to_thread.run_sync(start)
        except RequestError as exc:
            await stream.aclose()
            raise request_error(exc, renames) from exc
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def _note(self, event: dict[str, Any]) -> None:
        now = time.perf_counter()
        if event["type"] == "final":
            self.final = event
            self._metrics.prompt_tokens.inc(event["usage"]["prompt_tokens"])
            self._metrics.generation_tokens.inc(event["usage"]["completion_tokens"])
            return
        if event["token_ids"]:
            if self._t_last_token is None:
                self._metrics.ttft.observe(now - self._t_received)
            else:
                self._metrics.itl.observe(now - self._t_last_token)
            self._t_last_token = now
            self.token_ids.extend(event["token_ids"])

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event, the ``final`` one last. The stream is closed when this ends,
        is cancelled or is abandoned."""
        try:
            event = self._first
            self._first = None
            while event is not None:
                self._note(event)
                yield event
                if event["type"] == "final":
                    return
                self._check_deadline()
                event = await anyio.to_thread.run_sync(next, self._gen, None)
        finally:
            await self.aclose()

    def _check_deadline(self) -> None:
        """Raise a 408 once ``server.request_timeout_s`` has passed (the caller's
        ``finally`` then closes the stream, aborting the sequence)."""
        if self._deadline is not None and time.perf_counter() > self._deadline:
            timeout_s = self._engine.config.server.request_timeout_s
            raise ApiError(408, f"request timed out after {timeout_s:g} s (server.request_timeout_s)",
                           code="timeout")

    async def aclose(self) -> None:
        """Close the engine stream (abort the sequence unless it finished); idempotent."""
        gen, self._gen = self._gen, None
        if gen is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(gen.close)


async def run_to_end(stream: EngineStream, request) -> tuple[str, dict[str, Any]]:
    """Collect a whole generation for a non-streamed response: ``(text, final event)``.
    Stops (and frees the sequence) if the client disconnects meanwhile."""
    parts: list[str] = []
    events = stream.events()
    try:
        async for event in events:
            if event["type"] == "final":
                return "".join(parts), event
            parts.append(event["text"])
            if await request.is_disconnected():
                break
    finally:
        await events.aclose()
        await stream.aclose()
    raise ApiError(499, "client disconnected")
