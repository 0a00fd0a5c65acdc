"""Counting answered HTTP requests by route and status, shared by the server and the
data-parallel front end (their ``zllm_requests_total`` / ``zllm_dp_requests_total``)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def route_label(path: str, routes: Collection[str]) -> str:
    """The ``route`` label of a request ``path``: itself when in ``routes``, ``/v1/models/{id}``,
    ``/v1/responses/{id}`` or ``other`` (unknown paths share one label so clients cannot grow
    the label set). A trailing ``/`` is ignored."""
    path = path.rstrip("/") or "/"
    if path in routes:
        return path
    for prefix in ("/v1/models/", "/v1/responses/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return "other"


async def answer_counted(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                         count: Callable[[str], None]) -> None:
    """Run ``app`` on an HTTP request, then call ``count`` with the response's status code as a
    string (``"500"`` when ``app`` raised before starting a response), however ``app`` ends."""
    status = {"code": 500}

    async def send_wrapper(message: Message) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]
        await send(message)

    try:
        await app(scope, receive, send_wrapper)
    finally:
        count(str(status["code"]))
