"""Drive one engine stream from the event loop.

The engine's own loop thread runs the model (:mod:`zllm.engine.loop`); a route consumes its
request's events with :meth:`zllm.Engine.agenerate_stream`, an async iterator fed by that
thread, so no worker thread waits per stream and N live streams form one continuous batch.
The request is parsed and tokenized once, on the event loop, by the stream's first
``__anext__`` (which also gives the prompt's length for Anthropic's ``message_start``).

Cancellation: when the client goes away, Starlette cancels the response task; the engine
stream's cancelled ``__anext__`` (or :meth:`EngineStream.aclose`) aborts the sequence, and
the engine loop frees its KV blocks before its next step.

Deadlines: ``server.request_timeout_s`` counts from the request's arrival and is handed to
the engine, whose scheduler drops the request within one step of it — from the queue,
unprefilled, if it was still waiting for admission — and the client gets a 408. A server
shutting down brings every deadline forward to the end of ``server.shutdown_timeout_s``
(:meth:`ServerState.begin_shutdown`); what is left then gets a 503. Both carry
``x-should-retry: false``: the SDKs would otherwise send the abandoned work again.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from zllm.server.errors import ApiError
from zllm.spec.errors import DeadlineExceeded, EngineFailedError, RequestError, UnsupportedRequestError

if TYPE_CHECKING:
    from starlette.requests import Request

    from zllm.server.common import ServerState


def request_error(exc: RequestError, renames: Mapping[str, str]) -> ApiError:
    """A 400 for an engine RequestError, with the field renamed to the protocol's name
    (:func:`rename_field`)."""
    field = rename_field(exc.field, renames)
    message = str(exc)
    if exc.field and message.startswith(exc.field + ":"):
        message = field + message[len(exc.field):]
    code = "unsupported_parameter" if isinstance(exc, UnsupportedRequestError) else "invalid_value"
    return ApiError(400, message, param=field or None, code=code)


def rename_field(field: str, renames: Mapping[str, str]) -> str:
    """An engine field path in a protocol's terms.

    ``renames`` maps engine paths to the protocol's; a key matches the whole path or its
    start up to a ``.`` or ``[`` (``response_format`` → ``text.format`` renames
    ``response_format.json_schema.schema`` too), the longest key wins, and ``[*]`` in a key
    stands for any list index, kept in the result (``tools[*].function`` → ``tools[*]``
    makes ``tools[2].function.name`` ``tools[2].name``)."""
    best: tuple[int, str] | None = None
    for key, new in renames.items():
        pattern = re.escape(key).replace(re.escape("[*]"), r"\[(\d+)\]")
        m = re.match(pattern + r"(?=$|[.\[])", field)
        if m and (best is None or m.end() > best[0]):
            parts = new.split("[*]")
            renamed = parts[0] + "".join(f"[{i}]{rest}" for i, rest in zip(m.groups(), parts[1:], strict=True))
            best = (m.end(), renamed)
    return field if best is None else best[1] + field[best[0]:]


def arrival_time(request: Request) -> float:
    """When the request arrived (:func:`time.monotonic` seconds), stamped by the app's outer
    middleware before the body was read; now if it is missing."""
    return request.scope.get("state", {}).get("zllm_arrival", time.monotonic())


class EngineStream:
    """One request's events (the Engine's ``delta`` events, then one ``final``).

    Build with :meth:`open`, which submits the request and waits for its first event, so
    request errors surface before a response starts.
    """

    def __init__(self, st: ServerState, arrived: float):
        self._st, self._engine, self._metrics = st, st.engine, st.metrics
        self._events: Any = None  # the engine's AsyncEventStream (server and engine are siblings)
        self._first: dict[str, Any] | None = None
        self._arrived = arrived
        timeout_s = self._engine.config.server.request_timeout_s
        self.deadline = None if timeout_s is None else arrived + timeout_s
        self._t_last_token: float | None = None
        self.final: dict[str, Any] | None = None
        self.prompt_tokens = 0

    @classmethod
    async def open(cls, st: ServerState, http_request: Request, request: dict[str, Any],
                   renames: Mapping[str, str]) -> EngineStream:
        """Submit ``request`` (the engine's Request JSON) and fetch its first event.

        Raises:
            ApiError: 400 for a request the engine rejects (named in the protocol's terms);
                408 / 503 when its deadline or the shutdown's passed first.
        """
        stream = cls(st, arrival_time(http_request))
        events = st.engine.agenerate_stream(request, deadline=stream.deadline)
        stream._events = events
        try:
            stream._first = await stream._next()
        except RequestError as exc:
            await stream.aclose()
            raise request_error(exc, renames) from exc
        except BaseException:
            await stream.aclose()
            raise
        stream.prompt_tokens = events.prompt_tokens or 0
        return stream

    async def _next(self) -> dict[str, Any] | None:
        assert self._events is not None
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            return None
        except DeadlineExceeded as exc:
            raise self._abandoned(exc) from exc
        except EngineFailedError as exc:
            # The engine cannot serve anymore (e.g. a rank of a parallel engine died): not the
            # client's fault, and retrying this server will not help.
            raise ApiError(503, f"the engine failed and ended the request: {exc}", code="engine_failed",
                           retry=False) from exc

    def _abandoned(self, exc: DeadlineExceeded) -> ApiError:
        """The answer to a request the runtime dropped at its deadline: 503 when the
        shutdown's deadline came first, else 408."""
        shutdown = self._st.shutdown_deadline
        if shutdown is not None and (self.deadline is None or shutdown <= self.deadline):
            return ApiError(503, f"the server is shutting down and ended the request when "
                            f"server.shutdown_timeout_s ran out ({exc})", code="server_shutting_down",
                            retry=False)
        timeout_s = self._engine.config.server.request_timeout_s
        return ApiError(408, f"request timed out after {timeout_s:g} s (server.request_timeout_s): {exc}",
                        code="timeout", retry=False)

    def _note(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        if event["type"] == "final":
            self.final = event
            self._metrics.prompt_tokens.inc(event["usage"]["prompt_tokens"])
            self._metrics.generation_tokens.inc(event["usage"]["completion_tokens"])
            return
        if event["token_ids"]:
            if self._t_last_token is None:
                self._metrics.ttft.observe(now - self._arrived)
            else:
                self._metrics.itl.observe(now - self._t_last_token)
            self._t_last_token = now

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """Every event, the ``final`` one last. The stream is closed when this ends,
        is cancelled or is abandoned.

        Raises:
            ApiError: 408 / 503 when the request's deadline or the shutdown's passed.
        """
        try:
            event = self._first
            self._first = None
            while event is not None:
                self._note(event)
                yield event
                if event["type"] == "final":
                    return
                event = await self._next()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the engine stream (abort the sequence unless it finished); idempotent."""
        events, self._events = self._events, None
        if events is not None:
            with anyio.CancelScope(shield=True):
                await events.aclose()


async def open_streams(st: ServerState, http_request: Request, requests: Sequence[dict[str, Any]],
                       renames: Mapping[str, str]) -> list[EngineStream]:
    """:meth:`EngineStream.open` for every request at once (the ``n`` choices of one HTTP
    request), so they are queued together and share the engine's steps.

    Raises:
        ApiError: the first request's (by index) that failed; every stream opened is closed.
    """
    tasks = [asyncio.ensure_future(EngineStream.open(st, http_request, r, renames)) for r in requests]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        await _close_opened(tasks, cancel=True)
        raise
    failed = next((t.exception() for t in tasks if t.exception() is not None), None)
    if failed is not None:
        await _close_opened(tasks)
        raise failed
    return [t.result() for t in tasks]


async def _close_opened(tasks: Sequence[asyncio.Future[EngineStream]], cancel: bool = False) -> None:
    with anyio.CancelScope(shield=True):
        for t in tasks:
            if cancel:
                t.cancel()
            try:
                stream = await t
            except BaseException:  # noqa: BLE001 - the request failed or was cancelled: nothing to close
                continue
            await stream.aclose()


async def merged_events(streams: Sequence[EngineStream]) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Every stream's events as ``(index in streams, event)`` in the order they arrive, each
    stream's ``final`` event last for it. Closing this generator, or an error from any stream
    (a deadline), closes every stream: the unfinished requests are aborted."""
    gens = [s.events() for s in streams]
    pending: dict[asyncio.Future[dict[str, Any]], int] = {
        asyncio.ensure_future(g.__anext__()): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                i = pending.pop(fut)
                try:
                    event = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, event
                pending[asyncio.ensure_future(gens[i].__anext__())] = i
    finally:
        with anyio.CancelScope(shield=True):
            for fut in pending:
                fut.cancel()
            for fut in pending:
                try:
                    await fut
                except BaseException:  # noqa: BLE001 - the stream is being closed either way
                    pass
            for g in gens:
                await g.aclose()
            for s in streams:
                await s.aclose()


async def run_all_to_end(streams: Sequence[EngineStream], request) -> list[tuple[str, dict[str, Any]]]:
    """Collect whole generations for a non-streamed response: per stream ``(text, final
    event)``, the final event with ``logprobs``: every delta's, concatenated (None when not
    asked for). Stops (and frees every sequence) if the client disconnects meanwhile.

    Raises:
        ApiError: 499 when the client disconnected; 408 / 503 as :meth:`EngineStream.events`.
    """
    parts: list[list[str]] = [[] for _ in streams]
    logprobs: list[list[dict[str, Any]] | None] = [None] * len(streams)
    finals: dict[int, dict[str, Any]] = {}
    events = merged_events(streams)
    try:
        async for i, event in events:
            if event["type"] == "final":
                finals[i] = {**event, "logprobs": logprobs[i]}
                if len(finals) == len(streams):
                    return [("".join(parts[k]), finals[k]) for k in range(len(streams))]
                continue
            parts[i].append(event["text"])
            if event["logprobs"] is not None:
                logprobs[i] = (logprobs[i] or []) + event["logprobs"]
            if await request.is_disconnected():
                break
    finally:
        await events.aclose()
    raise ApiError(499, "client disconnected")


async def run_to_end(stream: EngineStream, request) -> tuple[str, dict[str, Any]]:
    """:func:`run_all_to_end` for one stream."""
    return (await run_all_to_end([stream], request))[0]
