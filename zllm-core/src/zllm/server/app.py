"""The ASGI app: routes of every protocol, errors in each protocol's shape, metrics.

``create_app(engine)`` builds it; ``zllm serve`` runs it under uvicorn. Every user error is a
4xx in the protocol's own shape (:mod:`zllm.server.errors`); anything else is logged and
answered 500 in the same shape, and the server keeps serving.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from zllm.server import anthropic_messages, openai_chat, openai_completions, openai_responses, tokens
from zllm.server.common import ServerState, state
from zllm.server.errors import ApiError, error_response, validation_error
from zllm.server.request_count import answer_counted, route_label

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body accepted; larger ones get 413 (a context window of text is far smaller)."""


def served_model_name(engine) -> str:
    """``server.served_model_name`` from the config, else the model folder's or file's stem."""
    cfg = engine.config
    return cfg.server.served_model_name or Path(cfg.model.path).stem


def create_app(engine, *, model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> ASGIApp:
    """The HTTP app serving ``engine`` (a :class:`zllm.Engine`)."""
    app = FastAPI(title="zllm", summary="OpenAI- and Anthropic-compatible LLM inference", version="1")
    app.state.zllm = ServerState(engine, model_name or served_model_name(engine))
    app.state.zllm.responses = openai_responses.ResponseStore()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # Pydantic locations are already in the protocol's terms (the body models use its field
        # names); the routes' RENAMES are for the engine's RequestError fields only.
        return error_response(request.url.path, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        elif exc.status_code == 413:
            code = "request_too_large"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's answer to any failure of json.loads but a syntax error; the cause says which.
            message, code = body_parse_error(exc.__cause__), "invalid_json"
        # Keep the exception's headers: a 405 must name the allowed methods (RFC 9110 Allow).
        return error_response(request.url.path, ApiError(exc.status_code, message, code=code), exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    # HEAD as well as GET on the read-only routes (uptime checks and load balancers probe with HEAD).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        st = state(request)
        return {"object": "list", "data": [
            {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "zllm",
             "max_model_len": st.engine.llm.context_length}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        st = state(request)
        st.check_model(model_id)
        return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "zllm"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request):
        return Response(generate_latest(state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for module in (openai_completions, openai_chat, openai_responses, anthropic_messages, tokens):
        app.include_router(module.router)

    return _BodyLimit(_CountRequests(app), max_body_bytes)


def body_parse_error(cause: BaseException | None) -> str:
    """The message for a request body that ``json.loads`` failed on with ``cause`` (other than
    a syntax error, which pydantic reports with its position)."""
    if isinstance(cause, RecursionError):
        return ("the request body is not valid JSON here: its arrays/objects are nested too deeply to parse "
                f"(Python's json parser stops near {sys.getrecursionlimit()} levels)")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"the request body is not valid JSON here: it holds an integer literal of more than "
                f"{sys.get_int_max_str_digits()} digits")
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid JSON: it is not UTF-8 text"
    return f"the request body could not be parsed as JSON ({type(cause).__name__}: {cause})"


class _CountRequests:
    """ASGI middleware: stamp every HTTP request's arrival (``scope["state"]["zllm_arrival"]``,
    :func:`time.monotonic` seconds, before its body is read: ``server.request_timeout_s``
    counts from there) and count every answered one by route template and status."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.state = app.state  # so tests and callers can reach app.state through the wrapper

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["zllm_arrival"] = time.monotonic()

        def count(code: str) -> None:
            self.app.state.zllm.metrics.requests.labels(route_label(scope.get("path", ""), _ROUTES), code).inc()

        await answer_counted(self.app, scope, receive, send, count)


_ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                     "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
                     "/docs", "/openapi.json"})


class _BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, by ``Content-Length`` or while
    reading a chunked body, in the route's protocol error shape."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        too_large = ApiError(413, f"the request body is larger than {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _discard_body(receive)
            return await error_response(path, too_large)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, too_large.message)
            return message

        await self.app(scope, limited_receive, send)


async def _discard_body(receive, max_bytes: int = 64 * 1024 * 1024) -> None:
    # Read (a bounded amount of) the body so the client sees the 413 instead of a reset.
    seen = 0
    while seen < max_bytes:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        seen += len(message.get("body", b""))

