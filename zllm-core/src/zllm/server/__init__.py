"""``zllm serve``: OpenAI- and Anthropic-compatible HTTP APIs over one :class:`zllm.Engine`.

Each protocol module maps its fields onto the engine's one Request JSON
(:mod:`zllm.spec.request`); see docs/server.md for the routes and their field tables.

The app is imported on first use (PEP 562), so that a light submodule (the data-parallel
replica launcher) does not pay for every protocol module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zllm.server.app import create_app, served_model_name

__all__ = ["create_app", "served_model_name"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from zllm.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
