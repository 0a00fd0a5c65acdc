"""Connection limits of ``zllm serve``: a connection that sends nothing, or only part of a
request's headers, is closed after ``server.header_timeout_s`` (slowloris); a request
arriving while more than ``server.max_connections`` connections are open gets a 503 in the
protocol's shape. Every socket read here is bounded by a timeout far above the limits."""

from __future__ import annotations

import contextlib
import socket

import httpx
import pytest

from tests.conftest import MODEL_DIR
from tests.server.conftest import start_server

HEADER_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 3
READ_BOUND_S = 30.0  # a socket still open after this failed the test


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("limits"), MODEL_DIR / "hf",
                       server={"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": MAX_CONNECTIONS})
    yield srv
    srv.stop()


def _connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=READ_BOUND_S)
    return sock


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (raises on the bound)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_connection_that_sends_nothing_is_closed(limited_server):
    with _connect(limited_server) as sock:
        assert _closed_by_server(sock) == b""
    assert limited_server.healthy()


def test_a_connection_that_sends_part_of_its_headers_is_closed(limited_server):
    with _connect(limited_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        assert _closed_by_server(sock) == b""
    assert limited_server.healthy()


def test_a_kept_alive_connection_dribbling_its_next_request_is_closed(limited_server):
    with _connect(limited_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while b'{"status":"ok"}' not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _closed_by_server(sock) == b""


def test_headers_sent_in_pieces_within_the_timeout_are_served(limited_server):
    with _connect(limited_server) as sock:
        for piece in (b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"Connection: close\r\n\r\n"):
            sock.sendall(piece)
        answer = _closed_by_server(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')


def test_a_request_over_max_connections_gets_503_in_the_protocols_shape(limited_server):
    with contextlib.ExitStack() as stack:
        # Connections that completed a request and stay kept alive count as open.
        for _ in range(MAX_CONNECTIONS):
            sock = stack.enter_context(_connect(limited_server))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        r = httpx.post(f"{limited_server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "overloaded" and "server.max_connections" in err["message"]
        assert r.headers["retry-after"] == "1"
        r = httpx.post(f"{limited_server.url}/v1/messages",
                       json={"model": "hf", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    with httpx.Client(timeout=30) as client:  # the kept-alive sockets are closed: room again
        for _ in range(100):
            if client.get(f"{limited_server.url}/health").status_code == 200:
                break
        assert client.post(f"{limited_server.url}/v1/completions",
                           json={"prompt": "Once", "max_tokens": 2}).status_code == 200
