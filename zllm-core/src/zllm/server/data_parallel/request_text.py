"""What the front end reads of a request body: the text whose prefix the routing keys on, cut
into the pieces a follow-up turn repeats, and the tokens the request may occupy.

The front end only routes; it never validates. A body it cannot read (not JSON, a field of
the wrong type) is routed by load alone and the replica answers it with the protocol's 4xx.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from zllm.server.data_parallel.routing import request_cost

GENERATION_ROUTES = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_completion_tokens",
    "/v1/messages": "max_tokens",
    "/v1/responses": "max_output_tokens",
}
"""Routes that generate, and the field that caps what they generate."""


@attrs.frozen
class RequestText:
    """The routing view of one request.

    Attributes:
        segments: the text in the order the prompt renders it, one piece per message (a
            tools list and a system prompt are pieces of their own); empty for requests
            that generate nothing.
        cost_tokens: :func:`~zllm.server.data_parallel.routing.request_cost` of it.
        previous_response_id: a Responses request's ``previous_response_id`` (its stored
            conversation lives on one replica), else None.
    """

    segments: tuple[str, ...] = ()
    cost_tokens: int = 0
    previous_response_id: str | None = None


def read_request(path: str, body: bytes, default_max_tokens: int) -> RequestText:
    """The routing view of a request to ``path`` with raw JSON ``body``; a generation request
    without a token cap counts ``default_max_tokens`` (``generation.max_new_tokens``)."""
    cap_field = GENERATION_ROUTES.get(path.rstrip("/"))
    try:
        data = json.loads(body) if body else {}
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return RequestText(cost_tokens=request_cost(len(body), 0))
    if cap_field is None:
        return RequestText(cost_tokens=request_cost(len(body), 0))
    segments = tuple(_segments(path.rstrip("/"), data))
    cap = data.get(cap_field)
    if cap is None and cap_field == "max_completion_tokens":
        cap = data.get("max_tokens")
    n = data.get("n", 1)
    text_bytes = sum(len(s.encode("utf-8", "surrogatepass")) for s in segments)
    cost = request_cost(text_bytes, _int(cap, default_max_tokens), _int(n, 1))
    previous = data.get("previous_response_id")
    return RequestText(segments, cost, previous if isinstance(previous, str) else None)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _text(value: Any) -> str:
    # Content parts, tool calls and non-string prompts key on their canonical JSON: a
    # follow-up repeats them byte for byte, which is all a prefix match needs.
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _messages(messages: Any) -> list[str]:
    if not isinstance(messages, list):
        return [_text(messages)]
    out = []
    for m in messages:
        if isinstance(m, Mapping):
            rest = {k: v for k, v in m.items() if k not in ("role", "content")}
            out.append(f"{m.get('role')}\n{_text(m.get('content'))}" + (f"\n{_text(rest)}" if rest else ""))
        else:
            out.append(_text(m))
    return out


def _segments(path: str, data: dict[str, Any]) -> list[str]:
    if path == "/v1/completions":
        return [_text(data.get("prompt", ""))]
    head = [_text(data["tools"])] if data.get("tools") else []
    if path == "/v1/chat/completions":
        return head + _messages(data.get("messages"))
    if path == "/v1/messages":
        system = [f"system\n{_text(data['system'])}"] if data.get("system") else []
        return head + system + _messages(data.get("messages"))
    instructions = [f"instructions\n{_text(data['instructions'])}"] if data.get("instructions") else []
    items = data.get("input", "")
    return head + instructions + (_messages(items) if isinstance(items, list) else [f"user\n{_text(items)}"])
