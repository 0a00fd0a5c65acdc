"""zllm: LLM inference through plugins. ``zllm.Engine`` is the in-process entry point.

Importing ``zllm`` imports no device runtime and no plugin; ``Engine`` is loaded lazily.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineClosedError", "EngineLoopError", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from zllm.engine.engine import Engine

        return Engine
    if name in ("EngineClosedError", "EngineLoopError"):
        from zllm.engine import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'zllm' has no attribute {name!r}")
