"""``zllm serve``: OpenAI- and Anthropic-compatible HTTP APIs over one :class:`zllm.Engine`.

Each protocol module maps its fields onto the engine's one Request JSON
(:mod:`zllm.spec.request`); see docs/server.md for the routes and their field tables.
"""

from zllm.server.app import create_app, served_model_name

__all__ = ["create_app", "served_model_name"]
