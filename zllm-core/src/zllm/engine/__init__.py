"""In-process entry: :class:`zllm.engine.engine.Engine`."""
