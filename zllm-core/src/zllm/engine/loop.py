"""The engine loop: one thread owns the runtime (:class:`~zllm.runtime.llm_engine.LLMEngine`:
its scheduler, KV cache and model) and steps it.

Callers never touch the runtime. They send commands through one thread-safe inbox — submit a
request, abort one, run a function between steps — and each request's
:class:`~zllm.runtime.llm_engine.StepOutput` items flow back through its own
:class:`RequestHandle`: a blocking queue for a consumer thread, or an :mod:`asyncio` queue fed
by ``call_soon_threadsafe`` for a coroutine (one wake-up per event loop per step, however
many of its requests the step advanced). So one step advances every live request — one
continuous batch — without any request thread holding a lock, and the model runs on one
thread whether the consumers are threads, tasks or both (vLLM's ``EngineCore`` busy loop has
the same shape, with a process boundary where this has a thread).

Each iteration takes every pending command (blocking on the inbox only when nothing is
queued or running, so an idle loop does not spin), then runs one step and hands its
outputs to their requests. Errors:

- a submit the runtime rejects (an empty prompt, a token outside the vocabulary, a prompt
  longer than the context or than the whole KV pool) fails that submit only;
- an exception from a step is an engine failure: every live request and every later call
  gets :class:`EngineLoopError` naming it, and the thread ends;
- :meth:`EngineLoop.close` ends live requests with :class:`EngineClosedError`, stops the
  thread and joins it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import attrs

from zllm.runtime.llm_engine import LLMEngine, StepOutput
from zllm.runtime.sequence import Sequence, TokenConstraint
from zllm.spec.errors import EngineFailedError
from zllm.spec.request import GenerationRequest

T = TypeVar("T")


class EngineLoopError(EngineFailedError):
    """The engine loop failed while stepping (a bug or a device failure, not a bad request):
    every live request ended with this error and the engine accepts no more. The step's
    exception is ``__cause__``."""


class EngineClosedError(EngineLoopError):
    """The engine was closed (:meth:`zllm.Engine.close`) before or while this request ran."""


class RequestHandle:
    """One submitted request as its consumer sees it.

    Attributes:
        prompt_tokens: the prompt's length in tokens (known before the submit is sent).
        accepted: resolves once the loop queued the request (its result is None) or with the
            error that rejected it (a ``RequestError`` subclass).
        seq: the runtime's sequence, set by the loop thread on acceptance; read its
            ``output_ids`` / ``finish_reason`` / ``cached_tokens`` only after its finished
            output arrived (the loop no longer writes them then).
        finished: set by the consumer once it took the finished output or an error.
    """

    __slots__ = ("prompt_tokens", "accepted", "seq", "finished", "_loop", "_sync", "_async", "_aloop")

    def __init__(self, loop: EngineLoop, prompt_tokens: int, aloop: asyncio.AbstractEventLoop | None):
        self._loop = loop
        self.prompt_tokens = prompt_tokens
        self.accepted: Future[None] = Future()
        self.seq: Sequence | None = None
        self.finished = False
        self._aloop = aloop
        self._sync: queue.SimpleQueue[StepOutput | BaseException] | None = None
        self._async: asyncio.Queue[StepOutput | BaseException] | None = None
        if aloop is None:
            self._sync = queue.SimpleQueue()
        else:
            self._async = asyncio.Queue()

    def get(self) -> StepOutput:
        """The next output, waiting for it (a handle submitted without an event loop).

        Raises:
            EngineLoopError: the engine failed or was closed meanwhile.
        """
        assert self._sync is not None, "an asyncio handle is read with aget()"
        return self._take(self._sync.get())

    async def aget(self) -> StepOutput:
        """The next output, awaited (a handle submitted from a running event loop)."""
        assert self._async is not None, "a thread's handle is read with get()"
        return self._take(await self._async.get())

    def _take(self, item: StepOutput | BaseException) -> StepOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self, wait: bool = True) -> None:
        """Abort the request unless it finished: the loop drops it before its next step,
        queued or running, and frees its KV blocks. ``wait``: return only once that is done
        (never from the loop thread itself, e.g. a generator collected there). A no-op on a
        loop that has ended (it freed everything)."""
        if self.finished:
            return
        self.finished = True
        self._loop.abort(self, wait=wait)

    def _deliver_sync(self, item: StepOutput | BaseException) -> None:
        assert self._sync is not None
        self._sync.put(item)


def _deliver_async(items: list[tuple[RequestHandle, StepOutput | BaseException]]) -> None:
    """Runs on an event loop: hand one step's items to that loop's handles."""
    for handle, item in items:
        assert handle._async is not None
        handle._async.put_nowait(item)


@attrs.frozen
class _Submit:
    handle: RequestHandle
    request: GenerationRequest
    prompt_ids: list[int]
    deadline: float | None
    constraint: TokenConstraint | None
    keep_special_ids: frozenset[int]


@attrs.frozen
class _Abort:
    handle: RequestHandle
    done: Future[None] | None


@attrs.frozen
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: Future[Any]


_STOP = object()


class EngineLoop:
    """The thread that owns ``llm``; started here, ended by :meth:`close` (or an engine
    failure). Every method is callable from any thread."""

    def __init__(self, llm: LLMEngine, name: str = "zllm-engine-loop"):
        self.llm = llm
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[int, RequestHandle] = {}  # by seq_id; touched by the loop thread only
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Any]]] = {}
        # Guards "has the loop ended? else enqueue" against "end the loop, fail what is
        # queued", so no command is left in an inbox nobody reads.
        self._state = threading.Lock()
        self._ended: EngineLoopError | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- callers' side -------------------------------------------------------------------

    def submit(self, request: GenerationRequest, prompt_ids: list[int], deadline: float | None,
               aloop: asyncio.AbstractEventLoop | None = None, *, constraint: TokenConstraint | None = None,
               keep_special_ids: frozenset[int] = frozenset()) -> RequestHandle:
        """Send a tokenized request; its acceptance arrives on ``handle.accepted``. ``aloop``:
        the event loop whose coroutine reads the outputs (None: a thread reads them);
        ``constraint`` and ``keep_special_ids`` as in :meth:`LLMEngine.add_request`.

        Raises:
            EngineLoopError: the loop has ended (failed or closed).
        """
        handle = RequestHandle(self, len(prompt_ids), aloop)
        self._send(_Submit(handle, request, prompt_ids, deadline, constraint, keep_special_ids))
        return handle

    def abort(self, handle: RequestHandle, wait: bool = True) -> None:
        """See :meth:`RequestHandle.abort`."""
        done: Future[None] | None = Future() if wait and not self.on_loop_thread() else None
        try:
            self._send(_Abort(handle, done))
        except EngineLoopError:
            return  # an ended loop freed every request
        if done is not None:
            done.result()

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(llm)`` on the loop thread between two steps and return its result (or
        raise its exception). Commands run in the order they were sent, so it also observes
        the effect of every earlier abort or submit.

        Raises:
            EngineLoopError: the loop has ended.
        """
        if self.on_loop_thread():
            return fn(self.llm)
        result: Future[T] = Future()
        self._send(_Call(fn, result))
        return result.result()

    def close(self) -> None:
        """End every live request with :class:`EngineClosedError`, stop the thread and join
        it; idempotent. Later calls raise :class:`EngineClosedError`."""
        try:
            self._send(_STOP)
        except EngineLoopError:
            pass
        if not self.on_loop_thread():
            self._thread.join()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, command: Any) -> None:
        with self._state:
            if self._ended is not None:
                raise self._ended
            self._inbox.put(command)

    # ---- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            # Block for commands only when idle: with work queued or running, take what is pending.
            while self._take_commands(block=not self.llm.has_work()):
                if self.llm.has_work():
                    for out in self.llm.step():
                        handle = self._live[out.seq.seq_id]
                        if out.finished:
                            del self._live[out.seq.seq_id]
                        self._post(handle, out)
                self._flush()
        except BaseException as exc:  # noqa: BLE001 - every waiter is told, then the thread ends
            error = EngineLoopError(f"the engine loop failed: {type(exc).__name__}: {exc}; every live "
                                    f"request was ended and the engine accepts no more")
            error.__cause__ = exc
            self._end(error)

    def _take_commands(self, block: bool) -> bool:
        """Handle every pending command, first waiting for one if ``block``; False once the
        loop has ended (a stop command came)."""
        command = self._inbox.get() if block and self._ended is None else self._next_command()
        while command is not None:
            if command is _STOP:
                self._end(EngineClosedError("the engine is closed"))
                return False
            self._handle(command)
            command = self._next_command()
        return self._ended is None

    def _next_command(self) -> Any:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Submit):
            handle = command.handle
            try:
                seq = self.llm.add_request(command.request, command.prompt_ids, command.request.max_tokens,
                                           constraint=command.constraint, keep_special_ids=command.keep_special_ids)
            except Exception as exc:  # noqa: BLE001 - a rejected request fails its own submit only
                handle.accepted.set_exception(exc)
                return
            seq.deadline = command.deadline
            handle.seq = seq
            self._live[seq.seq_id] = handle
            handle.accepted.set_result(None)
        elif isinstance(command, _Abort):
            aborted = command.handle.seq
            if aborted is not None and self._live.pop(aborted.seq_id, None) is not None:
                self.llm.abort(aborted)
            if command.done is not None:
                command.done.set_result(None)
        else:
            assert isinstance(command, _Call), command
            try:
                command.result.set_result(command.fn(self.llm))
            except Exception as exc:  # noqa: BLE001 - the caller raises it
                command.result.set_exception(exc)

    def _post(self, handle: RequestHandle, item: StepOutput | BaseException) -> None:
        if handle._aloop is None:
            handle._deliver_sync(item)
        else:
            self._outbox.setdefault(handle._aloop, []).append((handle, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for aloop, items in outbox.items():
            try:
                aloop.call_soon_threadsafe(_deliver_async, items)
            except RuntimeError:  # that event loop is closed: nobody reads these requests
                for handle, _ in items:
                    seq = handle.seq
                    if seq is not None and self._live.pop(seq.seq_id, None) is not None:
                        self.llm.abort(seq)

    def _end(self, error: EngineLoopError) -> None:
        """Fail every live request and every queued command with ``error``; free their KV."""
        with self._state:
            self._ended = error
            pending = []
            while (command := self._next_command()) is not None:
                pending.append(command)
        for handle in self._live.values():
            if handle.seq is not None and handle.seq.finish_reason is None:
                try:
                    self.llm.abort(handle.seq)
                except Exception:  # noqa: BLE001, S110 - a failed runtime may not abort; the error is told below
                    pass
            self._post(handle, error)
        self._live.clear()
        for command in pending:
            if isinstance(command, _Submit):
                command.handle.accepted.set_exception(error)
            elif isinstance(command, _Abort) and command.done is not None:
                command.done.set_result(None)
            elif isinstance(command, _Call):
                command.result.set_exception(error)
        try:
            self._flush()
        except Exception:  # noqa: BLE001, S110 - an abort inside a failed runtime; nothing left to tell
            pass
