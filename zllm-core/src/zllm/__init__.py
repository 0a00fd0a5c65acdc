"""zllm: LLM inference through plugins. ``zllm.Engine`` is the in-process entry point.

Importing ``zllm`` imports no device runtime and no plugin; ``Engine`` is loaded lazily.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from zllm.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'zllm' has no attribute {name!r}")
