"""The app under uvicorn, with the limits a public socket needs and a clean shutdown.

* **Header timeout** (slowloris). uvicorn times out only idle kept-alive connections, after a
  response; a connection that sends nothing, or dribbles a request's headers, stays open for
  ever. :func:`protocol_class` adds a timer (``server.header_timeout_s``) running from the
  connection's opening, and from the first byte of each later request, until h11 has parsed
  the request's headers; when it fires the connection is closed.
* **Open connections** (``server.max_connections``). A request arriving while more
  connections are open is answered 503 in its protocol's error shape (uvicorn's own
  ``limit_concurrency`` answers plain text) with ``Connection: close`` and ``Retry-After``.
* **Shutdown.** SIGTERM or SIGINT stops accepting connections and gives running requests
  ``server.shutdown_timeout_s`` (:meth:`ServerState.begin_shutdown`); what is left then ends
  with a 503 or a last ``error`` event. uvicorn re-raises the signal it caught once it is done,
  so the process would die by it (status 143 for SIGTERM); :class:`Server` does not, and
  ``zllm serve`` exits 0 after a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Generator
from typing import Protocol

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from zllm.server.common import ServerState
from zllm.server.errors import ApiError, error_response

SHUTDOWN_GRACE_S = 2.0
"""Seconds after ``server.shutdown_timeout_s`` before uvicorn cancels what still runs (a
response task that never reaches the engine, e.g. one blocked writing to a stalled client)."""


def protocol_class(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout and a connection limit (see above)."""

    class LimitedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            app = self.app

            async def limited(scope, receive, send):
                if scope["type"] == "http" and len(self.connections) > max_connections:
                    err = ApiError(503, f"the server has more than {max_connections} open connections "
                                   "(server.max_connections); retry later", code="overloaded")
                    response = error_response(scope.get("path", ""), err,
                                              {"connection": "close", "retry-after": "1"})
                    return await response(scope, receive, send)
                return await app(scope, receive, send)

            self.app = limited

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the first byte of a request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection that sent no complete request headers in %g s "
                                 "(server.header_timeout_s)", header_timeout_s)
                self.transport.close()

    return LimitedH11Protocol


class Drains(Protocol):
    """What :class:`Server` tells of a shutdown: :class:`ServerState`, or the data-parallel
    front end (which passes it on to its replicas)."""

    def begin_shutdown(self, timeout_s: float) -> None: ...


class Server(uvicorn.Server):
    """uvicorn's server with a bounded graceful shutdown and no re-raised signal."""

    def __init__(self, config: uvicorn.Config, state: Drains, shutdown_timeout_s: float):
        super().__init__(config)
        self._state, self._shutdown_timeout_s = state, shutdown_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._state.begin_shutdown(self._shutdown_timeout_s)
        await super().shutdown(sockets)


def serve(app, host: str, port: int, *, log_level: str = "info", access_log: bool = False) -> None:
    """Run ``app`` (from :func:`zllm.server.create_app`) on ``host:port`` until SIGTERM or
    SIGINT, under the engine config's ``server`` limits; returns after a graceful stop."""
    state: ServerState = app.state.zllm
    cfg = state.engine.config.server
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log,
        http=protocol_class(cfg.header_timeout_s, cfg.max_connections),
        timeout_graceful_shutdown=cfg.shutdown_timeout_s + SHUTDOWN_GRACE_S,
    )
    Server(config, state, cfg.shutdown_timeout_s).run()
