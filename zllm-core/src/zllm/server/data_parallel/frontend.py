"""The data-parallel front end: one HTTP endpoint relaying every request to a replica.

Transport: plain HTTP over loopback, with httpx (one connection pool per replica). Each
replica is a complete ``zllm serve``, so every protocol, its validation and its error shapes
stay in one place; the front end reads a request only to route it (:mod:`.request_text`,
:mod:`.routing`) and relays the answer byte for byte.

* **Streams pass through unbuffered**: each chunk the replica writes is written on at once.
* **Cancellation reaches the replica**: when the client goes away (before the answer starts,
  or during a stream) the front end closes its connection to the replica, which aborts the
  request and frees its KV cache as it does for any client.
* **A replica that dies** is taken out of rotation by its watcher; a request it was serving
  fails with 503 in its protocol's shape (as the status before the answer starts, as the
  protocol's last ``error`` event in a stream already running), and the other replicas keep
  serving. A replica that refuses the connection has not seen the request, which then goes
  to another one.
* Every relayed answer names its replica in the ``x-zllm-replica`` header.
* Stored Responses live on the replica that made them: ``GET``/``DELETE
  /v1/responses/{id}`` ask every replica, and a request with ``previous_response_id`` goes to
  the replica holding that response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from urllib.parse import quote

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from zllm.server.app import MAX_BODY_BYTES, _BodyLimit
from zllm.server.data_parallel.metrics import ROUTES, FrontEndMetrics
from zllm.server.data_parallel.request_text import read_request
from zllm.server.data_parallel.routing import NoReplicaError, Route, Router
from zllm.server.errors import ApiError, error_body, error_response, is_anthropic
from zllm.server.request_count import answer_counted, route_label

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-zllm-replica"
"""Response header naming the replica (its index) that answered."""

CONNECT_TIMEOUT_S = 5.0

CLIENT_GONE = 499
"""Status counted in ``zllm_dp_requests_total`` for a request whose client left before its
answer started (nginx's "client closed request"; nobody receives it)."""

# Not relayed: hop-by-hop headers (RFC 9110 7.6.1), the length (the front end re-frames the
# body) and what uvicorn sets for its own response.
_REQUEST_SKIP = frozenset({b"host", b"connection", b"keep-alive", b"content-length", b"transfer-encoding",
                           b"upgrade", b"te", b"trailer", b"proxy-connection"})
_RESPONSE_SKIP = frozenset({"connection", "keep-alive", "content-length", "transfer-encoding", "upgrade", "te",
                            "trailer", "date", "server"})
_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":(\d+)')


class FrontEnd:
    """The front end's state: the replicas' URLs and clients, the router and the metrics.

    Args:
        urls: each replica's base URL, by index.
        default_max_tokens: ``generation.max_new_tokens``, the cap a request without one
            counts for its load.
        max_connections: connections kept open to each replica (``server.max_connections``).
        pids: each replica's process id, reported by ``/health``.
    """

    def __init__(self, urls: list[str], default_max_tokens: int, max_connections: int = 256,
                 pids: list[int] | None = None):
        self.urls = urls
        self.pids = pids
        self.router = Router(len(urls))
        self.default_max_tokens = default_max_tokens
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # No read timeout: a generation may run for as long as the replica lets it.
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        self.clients = [httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) for url in urls]
        self.metrics = FrontEndMetrics(self)
        self.on_startup: list[Callable[[FrontEnd], None]] = []
        self.on_shutdown: list[Callable[[float], None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    def replica_exited(self, index: int, returncode: int) -> None:
        """Take replica ``index``, whose process exited with ``returncode``, out of rotation
        (call on the event loop)."""
        self.take_out(index, f"exited with status {returncode}")

    def take_out(self, index: int, why: str) -> None:
        """Stop routing to replica ``index`` and log ``why`` (once; not while stopping)."""
        if self.router.alive[index]:
            self.router.take_out(index)
            if self.stopping:
                return
            log.error("data-parallel replica %d (%s) %s; taken out of rotation, %d of %d left", index,
                      self.urls[index], why, sum(self.router.alive), len(self.urls))

    def replica_exited_threadsafe(self, index: int, returncode: int) -> None:
        """:meth:`replica_exited` from any thread (a replica's watcher); nothing once the
        front end is stopping (it stopped the replicas, and its loop may be closed)."""
        assert self.loop is not None, "the app has not started"
        if self.stopping:
            return
        try:
            self.loop.call_soon_threadsafe(self.replica_exited, index, returncode)
        except RuntimeError:  # the loop closed after the check above: the front end has stopped
            pass

    def begin_shutdown(self, timeout_s: float) -> None:
        """Run the shutdown callbacks (the replicas drain their own requests for ``timeout_s``)."""
        self.stopping = True
        for callback in self.on_shutdown:
            callback(timeout_s)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def create_frontend_app(frontend: FrontEnd, max_body_bytes: int = MAX_BODY_BYTES) -> ASGIApp:
    """The front end's ASGI app: ``/health`` and ``/metrics`` of its own, every other route
    relayed to a replica (see the module docstring)."""
    app = Starlette(
        routes=[
            HttpRoute("/health", _health, methods=["GET", "HEAD"]),
            HttpRoute("/metrics", _metrics, methods=["GET", "HEAD"]),
            HttpRoute("/v1/responses/{response_id:path}", _stored_response, methods=["GET", "DELETE"]),
            HttpRoute("/{path:path}", _relay, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
        ],
        lifespan=_lifespan,
        exception_handlers={StarletteHTTPException: _http_error, Exception: _internal_error},
    )
    app.state.zllm = frontend
    return _BodyLimit(_CountRequests(app), max_body_bytes)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    frontend: FrontEnd = app.state.zllm
    frontend.loop = asyncio.get_running_loop()
    for start in frontend.on_startup:
        start(frontend)
    yield
    await frontend.aclose()


class _CountRequests:
    """ASGI middleware counting every answered request by route and status."""

    def __init__(self, app: Starlette):
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        def count(code: str) -> None:
            self.state.zllm.metrics.requests.labels(route_label(scope.get("path", ""), ROUTES), code).inc()

        await answer_counted(self.app, scope, receive, send, count)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = "request_too_large" if exc.status_code == 413 else None
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    return error_response(request.url.path, ApiError(exc.status_code, message, code=code), exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error relaying %s", request.url.path)
    return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _frontend(request: Request) -> FrontEnd:
    return request.app.state.zllm


async def _health(request: Request) -> Response:
    fe = _frontend(request)
    router = fe.router
    replicas = [{"replica": i, "url": url, "pid": fe.pids[i] if fe.pids else None, "up": router.alive[i],
                 "requests_in_flight": router.in_flight[i], "load_tokens": router.load_tokens[i]}
                for i, url in enumerate(fe.urls)]
    up = any(router.alive)
    return JSONResponse({"status": "ok" if up else "unavailable", "replicas": replicas}, status_code=200 if up else 503)


async def _metrics(request: Request) -> Response:
    # Collecting asks every replica for its own metrics over HTTP: off the event loop.
    text = await asyncio.to_thread(generate_latest, _frontend(request).metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def _stored_response(request: Request) -> Response:
    """A stored response lives on one replica: ask them all, answer with the first that has it."""
    fe = _frontend(request)
    answer: httpx.Response | None = None
    for i, client in enumerate(fe.clients):
        if not fe.router.alive[i]:
            continue
        try:
            reply = await client.request(request.method, request.url.path, params=request.query_params)
        except httpx.TransportError:
            continue
        answer = reply
        if reply.status_code != 404:
            return _plain_response(reply, i)
    if answer is None:
        return _unavailable(request.url.path, fe)
    return _plain_response(answer, None)


async def _holder_of(fe: FrontEnd, response_id: str) -> int | None:
    """The live replica that stores Responses result ``response_id``, if any."""
    for i, client in enumerate(fe.clients):
        if fe.router.alive[i]:
            try:
                if (await client.get(f"/v1/responses/{quote(response_id, safe='')}")).status_code == 200:
                    return i
            except httpx.TransportError:
                continue
    return None


async def _relay(request: Request) -> Response:
    fe = _frontend(request)
    path = request.url.path
    try:
        body = await request.body()
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    view = read_request(path, body, fe.default_max_tokens) if request.method == "POST" else None
    holder = await _holder_of(fe, view.previous_response_id) if view and view.previous_response_id else None
    while True:
        try:
            if holder is not None and fe.router.alive[holder]:
                route = fe.router.pin(holder, view.cost_tokens if view else 0)
            elif view is not None:
                route = fe.router.choose(view.segments, view.cost_tokens)
            else:
                route = fe.router.choose((), 0)
        except NoReplicaError:
            return _unavailable(path, fe)
        fe.metrics.routed.labels(str(route.replica), route.reason).inc()
        try:
            upstream = await _send_until_disconnect(request, fe.clients[route.replica], body)
        except httpx.ConnectError as exc:
            # Refused: the replica is gone (its watcher may not have said so yet) and never
            # saw the request, so another replica can take it.
            fe.router.release(route)
            fe.take_out(route.replica, f"refused a connection ({exc})")
            holder = None
            continue
        except httpx.TransportError as exc:
            fe.router.release(route)
            return error_response(path, _replica_failed(route.replica, exc))
        except ClientDisconnect:
            fe.router.release(route)
            return Response(status_code=CLIENT_GONE)
        except BaseException:
            fe.router.release(route)
            raise
        return _RelayResponse(_Relay(fe.router, route, upstream, path))


async def _send_until_disconnect(request: Request, client: httpx.AsyncClient, body: bytes) -> httpx.Response:
    """Send the request upstream and return once the replica's answer starts; if the client
    goes first, cancel the upstream request (closing its connection, which the replica sees
    as its client leaving) and raise ClientDisconnect."""
    headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _REQUEST_SKIP]
    upstream_request = client.build_request(request.method, request.url.path, params=request.query_params,
                                            headers=headers, content=body)
    sending = asyncio.ensure_future(client.send(upstream_request, stream=True))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        sending.cancel()
        raise
    finally:
        gone.cancel()
    if sending.done():
        return sending.result()
    sending.cancel()
    try:
        late = await sending  # the answer may have started while the cancellation was on its way
    except asyncio.CancelledError:
        raise ClientDisconnect() from None
    await late.aclose()
    raise ClientDisconnect()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Relay:
    """One replica answer relayed to the client; :meth:`close` (idempotent) closes the
    upstream response and releases the request's load."""

    def __init__(self, router: Router, route: Route, upstream: httpx.Response, path: str):
        self.router, self.route, self.upstream, self.path = router, route, upstream, path
        self.event_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        # A Responses stream numbers its events; a last error event must carry the next number.
        self.numbered = self.event_stream and path.rstrip("/") == "/v1/responses"
        self._closed = False

    def headers(self) -> dict[str, str]:
        out = {k: v for k, v in self.upstream.headers.items() if k.lower() not in _RESPONSE_SKIP}
        out[REPLICA_HEADER] = str(self.route.replica)
        return out

    async def chunks(self) -> AsyncIterator[bytes]:
        last_sequence = -1
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.numbered:
                    numbers = _SEQUENCE_NUMBER.findall(chunk)
                    last_sequence = int(numbers[-1]) if numbers else last_sequence
                yield chunk
        except httpx.TransportError as exc:
            if not self.event_stream:
                raise
            yield _stream_error(self.path, _replica_failed(self.route.replica, exc), last_sequence + 1)
        finally:
            await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.router.release(self.route)
            await self.upstream.aclose()


class _RelayResponse(StreamingResponse):
    """A relayed answer that closes its upstream however the response ends (Starlette runs no
    background task when the client's disconnect surfaces as an error)."""

    def __init__(self, relay: _Relay):
        super().__init__(relay.chunks(), status_code=relay.upstream.status_code, headers=relay.headers())
        self._relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.close()


def _plain_response(reply: httpx.Response, replica: int | None) -> Response:
    headers = {k: v for k, v in reply.headers.items() if k.lower() not in _RESPONSE_SKIP}
    if replica is not None:
        headers[REPLICA_HEADER] = str(replica)
    return Response(reply.content, status_code=reply.status_code, headers=headers)


def _replica_failed(replica: int, exc: Exception) -> ApiError:
    return ApiError(503, f"data-parallel replica {replica} failed while serving this request "
                    f"({type(exc).__name__}); the other replicas keep serving", code="replica_failed")


def _unavailable(path: str, fe: FrontEnd) -> Response:
    return error_response(path, ApiError(503, f"no replica is serving: all {len(fe.urls)} replicas "
                                         "(parallel.data) have exited", code="no_replica"))


def _stream_error(path: str, err: ApiError, sequence_number: int) -> bytes:
    """The protocol's last ``error`` event of a stream (as :func:`zllm.server.common.sse_response`
    and the Responses route write it)."""
    if is_anthropic(path):
        return f"event: error\ndata: {json.dumps(error_body(path, err))}\n\n".encode()
    if path.rstrip("/") == "/v1/responses":
        event = {"type": "error", "code": err.code, "message": err.message, "param": err.param,
                 "sequence_number": sequence_number}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {json.dumps(error_body(path, err))}\n\n".encode()
