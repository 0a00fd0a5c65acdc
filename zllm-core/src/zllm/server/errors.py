"""Errors in each protocol's own shape.

One exception, :class:`ApiError`, carries what every protocol needs (HTTP status, message,
the offending field); the app's exception handlers render it as OpenAI's error object on
``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/models``, and as
Anthropic's on ``/v1/messages``:

* OpenAI: ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes)
* Anthropic: ``{"type": "error", "error": {"type", "message"}}``
  (https://docs.anthropic.com/en/api/errors)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

ANTHROPIC_PATHS = ("/v1/messages",)

SHOULD_RETRY_HEADER = "x-should-retry"
"""Response header both official SDKs read before their own retry rules (openai-python and
anthropic-sdk-python ``_should_retry``)."""

# HTTP status -> (OpenAI error type, Anthropic error type)
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("timeout", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """A request the server answers with an error.

    Args:
        status: HTTP status (4xx for anything the client caused).
        message: one line naming the bad value and what is valid.
        param: the request field at fault, in the protocol's own naming
            (``messages[0].content``), or None.
        code: a machine-readable code (OpenAI's ``code``), e.g. ``model_not_found``.
        retry: False for work the server chose to abandon (a deadline passed, a shutdown):
            the answer carries ``x-should-retry: false``, which the openai and anthropic SDKs
            honour instead of retrying a 408 or 5xx. None leaves the client to decide.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry: bool | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry = retry


def unsupported(field: str, why: str = "") -> ApiError:
    """A 400 for a field that would change generation but zllm does not implement."""
    tail = f": {why}" if why else ""
    return ApiError(400, f"{field} is not supported by zllm{tail}", param=field, code="unsupported_parameter")


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is Anthropic's (its routes and any path under them, e.g. an
    unimplemented ``/v1/messages/count_tokens``, answer in Anthropic's error shape)."""
    path = path.rstrip("/")
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_body(path: str, err: ApiError) -> dict[str, Any]:
    """The protocol's error JSON for a request to ``path``."""
    openai_type, anthropic_type = ERROR_TYPES.get(err.status, ("invalid_request_error", "invalid_request_error"))
    if is_anthropic(path):
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {"error": {"message": err.message, "type": openai_type, "param": err.param, "code": err.code}}


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII text escaped: an error message may quote client text, and a lone
    surrogate (valid as a JSON escape, not encodable as UTF-8) must not turn a 400 into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(path: str, err: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """``err`` as a JSON response in the protocol's shape for ``path``, with ``headers`` and,
    when ``err.retry`` is set, ``x-should-retry``."""
    all_headers = dict(headers or {})
    if err.retry is not None:
        all_headers[SHOULD_RETRY_HEADER] = "true" if err.retry else "false"
    return _AsciiJSONResponse(error_body(path, err), status_code=err.status, headers=all_headers)


# ------------------------------------------------------------------ pydantic -> ApiError

# Location parts pydantic adds for union members and validators, not field names.
def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part[:1].isupper()
        or any(c in part for c in "[-,")
        or part in {"str", "int", "float", "bool", "list", "dict", "none"}
    )


def _path(error: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where a pydantic error is, as field names and list indices in the request's own terms
    (``("messages", 0, "content")``); ``()`` for the body itself. The body models use the
    protocol's field names, so no renaming applies.

    Type tags pydantic puts into a location (union members) are dropped, except the last part
    of an unknown-field error, which is the client's key whatever it looks like
    (``Temperature``, ``a-b``, ``str``)."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    keep_last = error.get("type") == "extra_forbidden"
    return tuple(part for i, part in enumerate(loc)
                 if not _is_type_tag(part) or (keep_last and i == len(loc) - 1))


def _param(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = str(part) or '""'  # an empty key still names a field
            out += f".{name}" if out else name
    return out


def validation_error(errors: list[Mapping[str, Any]]) -> ApiError:
    """One 400 from pydantic/FastAPI validation errors: the first failing field, with every
    message about that field (a union reports one per member)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    path = _path(first)
    param = _param(path)
    if not param and first.get("type") == "missing":
        return ApiError(400, "the request body is empty; expected a JSON object", code="invalid_request")
    if not param and isinstance(first.get("input"), (bytes, bytearray)):
        return ApiError(400, "the request body was not read as JSON: send Content-Type: application/json",
                        code="invalid_request")
    msgs: list[str] = []
    for e in errors:
        if path and _path(e)[: len(path)] == path or _path(e) == path:  # the field, or inside it
            msg = _message(e)
            if msg not in msgs:
                msgs.append(msg)
    if not param:
        return ApiError(400, f"the request body must be a JSON object: {'; '.join(msgs)}", code="invalid_request")
    return ApiError(400, f"{param}: {' or '.join(msgs)}", param=param, code="invalid_value")


def _message(e: Mapping[str, Any]) -> str:
    kind = e.get("type")
    if kind == "extra_forbidden":
        return "unknown field (see docs/server.md for the fields each route accepts)"
    if kind == "missing":
        return "required field is missing"
    return str(e.get("msg", "invalid value"))
