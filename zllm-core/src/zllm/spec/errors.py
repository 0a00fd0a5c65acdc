"""Typed user-facing errors. Each carries its subject (key path, file, tensor, capability).

Every subclass of :class:`ZllmError` is a *user* error: the CLI prints its message on one
line and exits with status 2; ``--debug`` shows the traceback. Internal invariants use
``assert``, never these classes.
"""

from __future__ import annotations


class ZllmError(Exception):
    """Base class of every error a user can cause (bad config, file, request, plugin)."""


class ConfigError(ZllmError):
    """A config value is wrong. ``path`` is the dotted key path, e.g. ``runtime.kv_cache.block_size``."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class RequestError(ZllmError):
    """A generation request is invalid. ``field`` names the request field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class UnsupportedRequestError(RequestError):
    """A valid request asks for something zllm does not do (yet); ``field`` names it."""


class ContextLengthError(RequestError):
    """The prompt does not fit in the model's context window (with ``generating``, it must
    also leave room for one generated token)."""

    def __init__(self, prompt_tokens: int, context_length: int, generating: bool = False):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        room = " and must leave room for at least one generated token" if generating else ""
        super().__init__(
            "prompt",
            f"prompt is {prompt_tokens} tokens but the context window is {context_length} tokens{room}",
        )


class DeadlineExceeded(ZllmError):
    """A request's deadline passed before it finished; the runtime dropped it (unprefilled if
    it was still ``queued``, its KV blocks freed if it was running).

    Attributes:
        queued: True when it was still waiting for admission.
        output_tokens: tokens it had generated.
    """

    def __init__(self, queued: bool, output_tokens: int):
        self.queued, self.output_tokens = queued, output_tokens
        where = "while queued for admission" if queued else f"after generating {output_tokens} tokens"
        super().__init__(f"the request's deadline passed {where}")


class EngineFailedError(RuntimeError):
    """The engine can no longer run requests: its loop failed (a bug, a device failure, a rank
    of a parallel engine that died or hung) or it was closed. Not a user error; the HTTP
    server answers it 503. ``zllm.engine.loop.EngineLoopError`` is the engine's own subclass."""


class CheckpointError(ZllmError):
    """A weight, config or tokenizer file is missing, corrupt or inconsistent. ``file`` names it."""

    def __init__(self, file: str, message: str):
        self.file = str(file)
        super().__init__(f"{self.file}: {message}")


class TensorError(CheckpointError):
    """A tensor is missing, unused or mis-shaped. ``tensor`` names it (its canonical, HF
    name); ``file_tensor``, when the file calls it otherwise (a GGUF file's
    ``blk.0.attn_q.weight``), is the file's name, given beside it in the message."""

    def __init__(self, file: str, tensor: str, message: str, file_tensor: str | None = None):
        self.tensor = tensor
        self.file_tensor = file_tensor if file_tensor != tensor else None
        named = f"tensor {tensor!r}" + (f" (in the file: {self.file_tensor!r})" if self.file_tensor else "")
        super().__init__(file, f"{named}: {message}")


class UnknownArchitectureError(CheckpointError):
    """No installed model family handles the checkpoint's architecture."""


class CapabilityError(ZllmError):
    """A model family needs capabilities that the selected backend does not declare, or
    (with ``reasons``: capability -> why) that it declares but cannot run on this device."""

    def __init__(self, missing: list[str], backend: str, family: str, reasons: dict[str, str] | None = None):
        self.missing = sorted(missing)
        self.backend = backend
        self.family = family
        why = sorted(set((reasons or {}).values()))
        super().__init__(
            f"backend {backend!r} lacks capabilit{'y' if len(self.missing) == 1 else 'ies'} "
            f"{', '.join(self.missing)} needed by model family {family!r}"
            + (f" on this device: {'; '.join(why)}" if why else "")
        )


class KernelNotFound(ZllmError):
    """No kernel is registered for (op, backend, format). ``registered`` lists what exists for op."""

    def __init__(self, op: str, backend: str, fmt: str, registered: list[str], batch_invariant: bool = False):
        self.op, self.backend, self.fmt, self.registered = op, backend, fmt, registered
        self.batch_invariant = batch_invariant
        have = ", ".join(registered) if registered else "nothing"
        if batch_invariant:
            super().__init__(
                f"no batch-invariant kernel {op!r} for backend {backend!r} and format {fmt!r} "
                f"(runtime.batch_invariant is true); batch-invariant kernels for {op!r}: {have}"
            )
            return
        super().__init__(f"no kernel {op!r} for backend {backend!r} and format {fmt!r}; registered for {op!r}: {have}")


class BoundOpError(ZllmError):
    """A model called a bound op the way its binding does not allow: an op bound in several
    variants called without naming one, or a variant that was not bound. Names the op and
    what is bound."""


class PluginError(ZllmError):
    """A plugin cannot be used (not installed, filtered out, broken, unavailable device)."""


class BackendUnavailable(PluginError):
    """The configured backend exists but cannot run here; the message says why."""
