"""``zllm.Engine``: the in-process API with the same request/response JSON as the server.

One engine-loop thread (:mod:`zllm.engine.loop`) owns the runtime and steps it; ``Engine``
validates and tokenizes a request in the caller's thread, submits it to the loop and turns
its step outputs into Request JSON events. So any number of threads (``generate``,
``generate_stream``) and asyncio tasks (``agenerate_stream``, the HTTP server) may use one
engine at once, and their requests share every step.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import attrs

from zllm.domain.family import Model, model_kv_spec, model_mtp
from zllm.engine.chat_output import ChatAnswer, output_parser, prompt_in_reasoning
from zllm.engine.distributed import Launch, RankGroup, per_rank_config, spawn_workers
from zllm.engine.draft import load_draft
from zllm.engine.loader import LoadedModel, check_parallel_fits, kv_cache_dtype, load_model
from zllm.engine.loop import EngineLoop, RequestHandle
from zllm.engine.structured import StructuredOutput
from zllm.engine.tool_parsers import resolve_format
from zllm.plugins.host import PluginHost
from zllm.runtime.kv_cache import PagedKVCache
from zllm.runtime.llm_engine import LLMEngine, StepOutput
from zllm.runtime.mtp import MtpProposer
from zllm.runtime.scheduler import EXPIRED_RUNNING, EXPIRED_WAITING
from zllm.runtime.sequence import Sequence, TokenConstraint
from zllm.runtime.speculative import NgramProposer, Proposer
from zllm.spec.config import SPECULATIVE_METHODS, ZllmConfig, config_from_dict, load_config
from zllm.spec.errors import ConfigError, DeadlineExceeded, RequestError
from zllm.spec.request import (
    FinishReason,
    GenerationRequest,
    make_delta_event,
    make_final_event,
    make_logprobs,
    make_response,
    parse_request,
)
from zllm.tokenizer.chat import render_chat


def plugin_allowlist_from_env(environ: dict[str, str] | None = None) -> list[str] | None:
    """``ZLLM_PLUGINS`` (comma-separated entry-point names) or None when unset/empty."""
    value = (os.environ if environ is None else environ).get("ZLLM_PLUGINS", "")
    return [v for v in value.split(",") if v.strip()] or None


def make_proposer(loaded: LoadedModel, host: PluginHost) -> Proposer | None:
    """The proposer ``speculative.method`` names, or None when speculation is off.

    Raises:
        ConfigError: (``speculative.method``) ``mtp`` for a checkpoint without
            multi-token-prediction layers; names the checkpoint.
        ZllmError subclasses: a draft model that cannot serve the target
            (:func:`zllm.engine.draft.load_draft`).
    """
    cfg = loaded.config.speculative
    if cfg.method is None:
        return None
    if cfg.method == "draft":
        return load_draft(loaded, host, min(cast(Model, loaded.model).vocab_size, loaded.tokenizer.vocab_size))
    if cfg.method == "mtp":
        return _mtp_proposer(loaded)
    assert cfg.method == "ngram", cfg.method  # the config contract admits only implemented methods
    return NgramProposer(cfg.ngram.min_n, cfg.ngram.max_n)


def _mtp_proposer(loaded: LoadedModel) -> MtpProposer:
    """The target's own MTP layer as proposer, over a cache of its own with as many blocks as
    the target's plus each sequence's lookahead, so it never runs out before the target does."""
    mtp = model_mtp(loaded.model)
    if mtp is None:
        others = ", ".join(m for m in SPECULATIVE_METHODS if m != "mtp")
        raise ConfigError(
            "speculative.method",
            f"mtp needs a checkpoint with multi-token-prediction layers, and {loaded.checkpoint.path} "
            f"({loaded.family_info.name}, model_type {loaded.checkpoint.config.get('model_type')!r}) has none "
            f"(DeepSeek-V3 keeps them as model.layers.<num_hidden_layers>.* with num_nextn_predict_layers > 0; "
            f"checkpoints saved by transformers drop them); use one of: {others}",
        )
    cfg = loaded.config
    block_size = cfg.runtime.kv_cache.block_size
    per_seq = math.ceil((cfg.speculative.num_tokens + 1) / block_size) + 1
    kv = PagedKVCache(mtp.kv_spec, loaded.kv_num_blocks + cfg.runtime.max_num_seqs * per_seq, block_size,
                      dtype=kv_cache_dtype(cfg), device=loaded.backend.device)
    model = cast(Model, loaded.model)
    return MtpProposer(mtp, kv, loaded.backend.device, min(model.vocab_size, loaded.tokenizer.vocab_size))


T = TypeVar("T")


def on_a_passing_thread(build: Callable[[], T]) -> T:
    """``build()`` run on a new thread that ends when it returns; its result, or its exception
    re-raised here.

    An engine is built this way so that the work of loading (torch ops on the weights, the KV
    cache's allocation) does not leave an OpenMP thread pool behind on the caller's thread:
    libgomp keeps a thread's pool until that thread exits, and once it manages more threads than
    there are CPUs (that pool's idle workers plus the engine loop's team) it stops spinning
    between parallel regions, so every native kernel call of a decode step wakes its workers
    through the OS. Measured on 2 cores, Qwen3-MoE-shaped Q8_0 decode at 2 threads: the fused
    QKV GEMV 105 -> 53 us, the MoE call 296 -> 261 us, about 2 ms of a 14 ms step.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="zllm-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return cast(T, box["result"])


def _close(loop: EngineLoop, ranks: RankGroup | None) -> None:
    loop.close()
    if ranks is not None:
        ranks.close()


class Engine:
    """A loaded model ready to generate. Build it with :meth:`from_config`."""

    def __init__(self, loaded: LoadedModel, host: PluginHost, ranks: RankGroup | None = None):
        """``ranks``: the other ranks when ``loaded`` is rank 0's shard (:meth:`from_config` joins them)."""
        self.loaded, self.host = loaded, host
        cfg = loaded.config
        kv_spec = model_kv_spec(loaded.model)
        num_blocks = loaded.kv_num_blocks
        block_size = cfg.runtime.kv_cache.block_size
        dtype = kv_cache_dtype(cfg)
        try:
            kv = PagedKVCache(kv_spec, num_blocks, block_size, dtype=dtype, device=loaded.backend.device,
                              eviction_lag=cfg.speculative.num_tokens if cfg.speculative.method else 0)
        except (RuntimeError, MemoryError) as exc:  # torch reports a failed allocation as RuntimeError
            key = "num_blocks" if cfg.runtime.kv_cache.num_blocks else "block_size"
            nbytes = num_blocks * kv_spec.block_bytes(block_size, dtype.itemsize)
            raise ConfigError(
                f"runtime.kv_cache.{key}",
                f"{num_blocks} KV blocks of {block_size} tokens need {nbytes / 2**30:.1f} GiB, which cannot "
                f"be allocated on {loaded.backend.device}",
            ) from exc
        self.llm = LLMEngine(
            loaded.model if ranks is None else ranks.driver, loaded.ops, loaded.tokenizer, kv, loaded.eos_token_ids,
            max_num_seqs=cfg.runtime.max_num_seqs, max_prefill_tokens=cfg.runtime.max_prefill_tokens,
            prefix_cache_seqs=cfg.runtime.prefix_cache_seqs, context_length=loaded.context_length,
            device=loaded.backend.device, max_batch_tokens=cfg.runtime.max_batch_tokens,
            batch_invariant=cfg.runtime.batch_invariant, proposer=make_proposer(loaded, host),
            num_speculative_tokens=cfg.speculative.num_tokens, adaptive_lookahead=cfg.speculative.adaptive,
        )
        self.loop = EngineLoop(self.llm)
        """The thread that owns ``llm`` and steps it (:class:`zllm.engine.loop.EngineLoop`);
        read runtime state through ``loop.call`` while requests run."""
        # Stops the loop thread when the engine is closed, collected or the interpreter exits;
        # it holds the loop, never the engine, so an unclosed engine is still collected.
        self._finalizer = weakref.finalize(self, _close, self.loop, ranks)
        self.ranks = ranks
        """The other ranks of a parallel engine (``parallel.tensor`` > 1), else None."""
        self.tool_format = resolve_format(cfg.server.tool_parser, loaded.tokenizer.chat_template)
        """The chat format tool calls are read in (``server.tool_parser``), or None."""
        self.structured = StructuredOutput(loaded.tokenizer, self.llm.sample_width, loaded.eos_token_ids,
                                           self.tool_format)
        """Grammars of ``response_format`` and forced tool calls (compiled and cached per engine)."""

    @classmethod
    def from_config(cls, config: ZllmConfig | Mapping[str, Any] | str | os.PathLike[str], *,
                    host: PluginHost | None = None,
                    on_tensor: Callable[[str, int], None] | None = None,
                    on_start: Callable[[int], None] | None = None,
                    launch: Launch | None = None) -> Engine:
        """Load the model a config names.

        With ``parallel.tensor`` > 1 this process becomes rank 0: under torchrun (``launch``
        read from its environment, :func:`zllm.engine.distributed.launch_from_env`) the other
        ranks are torchrun's; without ``launch`` it starts them itself on this node.

        Args:
            config: a :class:`ZllmConfig`, a config mapping (as a parsed YAML file; a relative
                ``model.path`` is taken from the current directory) or the path of a YAML file.
            host: a plugin host; default discovers installed plugins, honouring ``ZLLM_PLUGINS``.
            on_start, on_tensor: load-progress callbacks (total bytes; each tensor).
            launch: rank 0's place under torchrun; None = one process, or self-spawned ranks.

        Raises:
            ZllmError subclasses for every user error (config, checkpoint, capability, plugin).
        """
        if isinstance(config, ZllmConfig):
            cfg = config
        elif isinstance(config, Mapping):  # a parsed config; relative paths against the cwd
            cfg = config_from_dict(config)
        elif isinstance(config, (str, os.PathLike)):
            cfg = load_config(Path(config))
        else:
            raise ConfigError(
                "", f"expected a ZllmConfig, a config mapping or a YAML file path, got {type(config).__name__}"
            )
        host = host or PluginHost(allowlist=plugin_allowlist_from_env())
        if cfg.parallel.world_size == 1 and launch is None:
            return on_a_passing_thread(lambda: cls(load_model(cfg, host, on_tensor=on_tensor, on_start=on_start), host))
        procs: list[multiprocessing.process.BaseProcess] = []
        if launch is None:
            check_parallel_fits(cfg, host)  # refuse bad sizes before any process starts
            launch, procs = spawn_workers(cfg)
        assert launch.rank == 0, "ranks other than 0 run zllm.engine.worker.run_worker"
        rank0 = launch

        def build() -> Engine:
            loaded = load_model(per_rank_config(cfg, rank0), host, on_tensor=on_tensor, on_start=on_start,
                                launch=rank0)
            return cls(loaded, host, RankGroup(loaded.model, loaded.backend.device, procs, cfg.parallel.timeout_s))

        try:
            return on_a_passing_thread(build)
        except BaseException:
            RankGroup.reap(procs)
            raise

    @property
    def config(self) -> ZllmConfig:
        return self.loaded.config

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def parse(self, request: dict[str, Any]) -> GenerationRequest:
        """Validate a request dict against the Request JSON contract (config defaults fill gaps)."""
        return parse_request(request, self.config.generation)

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids: given, encoded from ``prompt``, or ``messages`` rendered by
        the model's chat template with its generation prompt and the request's ``tools``
        (:func:`zllm.tokenizer.render_chat`).

        Raises:
            RequestError: ``messages`` for a model without a chat template (naming the
                checkpoint), or a conversation the template rejects; ``tools`` /
                ``messages[i].tool_calls`` when the template does not render them.
            CheckpointError: the chat template does not parse or the sandbox blocked it.
        """
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            if self.tokenizer.chat_template is None:
                raise RequestError("messages", f"model has no chat template ({self.loaded.checkpoint.path})")
            return render_chat(self.tokenizer, [m.to_dict() for m in req.messages], add_generation_prompt=True,
                               add_bos=req.add_bos, tools=req.tools or None)
        add = self.tokenizer.add_bos if req.add_bos is None else req.add_bos
        return self.tokenizer.encode(req.prompt, add_special_tokens=add)

    def submit(self, request: dict[str, Any] | GenerationRequest, *, deadline: float | None = None) -> RequestHandle:
        """Validate and tokenize a request (in the calling thread), queue it on the engine loop and
        wait until the loop accepted it; read its outputs with ``handle.get()``.

        ``deadline``: a :func:`time.monotonic` time after which the runtime drops the request,
        queued or running, within one step (its outputs then raise :class:`DeadlineExceeded`).

        Raises:
            RequestError: the request is invalid or its prompt does not fit (context window,
                vocabulary, the whole KV pool).
            EngineLoopError: the engine failed or was closed.
        """
        return self._submit(self.prepare(request), deadline)

    def prepare(self, request: dict[str, Any] | GenerationRequest) -> PreparedRequest:
        """Everything a request needs before the engine loop takes it, done in the calling
        thread: validation, the prompt's tokens, the answer parser and the compiled grammar
        of ``response_format`` or a forced tool call.

        Raises:
            RequestError: an invalid request (a grammar that does not compile included).
        """
        req = request if isinstance(request, GenerationRequest) else self.parse(request)
        ids = self.prompt_ids(req)
        in_reasoning = prompt_in_reasoning(self.tokenizer, req)
        return PreparedRequest(
            req, ids, ChatAnswer(output_parser(self.tool_format, self.tokenizer, req, in_reasoning)),
            self.structured.constraint(req, in_reasoning),
            self.structured.marker_ids if req.messages is not None else frozenset())

    def _submit(self, p: PreparedRequest, deadline: float | None) -> RequestHandle:
        handle = self.loop.submit(p.request, p.prompt_ids, deadline, constraint=p.constraint,
                                  keep_special_ids=p.keep_special_ids)
        handle.accepted.result()
        return handle

    def drain(self, deadline: float) -> None:
        """Bound every request's deadline, queued, running or submitted later, by ``deadline``
        (:func:`time.monotonic` seconds): a server shutting down ends what is left then.
        Callable from any thread (one attribute store the loop reads before each step)."""
        self.llm.scheduler.drain_deadline = deadline

    def close(self) -> None:
        """Stop the engine loop: requests still live end with :class:`EngineClosedError`, the
        loop thread is joined, and later calls raise :class:`EngineClosedError`. Idempotent;
        also run when the engine is garbage-collected or the interpreter exits."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _outputs(self, handle: RequestHandle) -> Iterator[StepOutput]:
        """The request's step outputs, its finished one last; closing the iterator before
        then aborts the request and waits until its KV blocks are free."""
        try:
            while True:
                out = handle.get()
                _check_expired(out)
                yield out
                if out.finished:
                    return
        finally:
            handle.abort(wait=True)

    def prompt_logits(self, prompt_ids: list[int]):
        """f32 ``[P, V]`` logits at every position of ``prompt_ids`` (for scoring and parity
        tests), computed on the engine loop between two steps."""
        ids = list(prompt_ids)
        return self.loop.call(lambda llm: llm.prompt_logits(ids))

    def generate_stream(self, request: dict[str, Any] | GenerationRequest, *,
                        deadline: float | None = None) -> EventStream:
        """Stream events: one per step that produced output (``text`` delta and
        ``token_ids``), then a final event with ``finish_reason`` and ``usage``.
        Closing the iterator early aborts the request and returns once its KV blocks are free.
        A chat request's deltas carry its answer parsed (``content``, ``reasoning_content``,
        ``tool_calls`` pieces) and the final event the whole of it; a last delta without
        tokens may carry what the parser held back.

        Raises:
            RequestError: at the call, for a request the engine rejects.
            DeadlineExceeded: from the iterator, once ``deadline`` (see :meth:`submit`) passed.
            EngineLoopError: from the iterator, when the engine failed or was closed.
        """
        p = self.prepare(request)
        handle = self._submit(p, deadline)
        return EventStream(handle, self._stream_events(handle, p.answer))

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs: "" for a padded logits column outside the vocabulary."""
        if token_id >= self.tokenizer.vocab_size:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, seq: Sequence, entries) -> list[dict[str, Any]] | None:
        return None if seq.request.logprobs is None else make_logprobs(entries, self.token_text)

    def _stream_events(self, handle: RequestHandle, answer: ChatAnswer) -> Iterator[dict[str, Any]]:
        for out in self._outputs(handle):
            yield from _step_events(out, answer, self._logprobs)

    def agenerate_stream(self, request: dict[str, Any] | GenerationRequest, *,
                         deadline: float | None = None) -> AsyncEventStream:
        """The events of :meth:`generate_stream` as an async iterator, for a coroutine on a
        running :mod:`asyncio` event loop; no thread waits on the engine meanwhile. The
        request is parsed, tokenized and submitted by the first ``__anext__``, which raises
        what :meth:`generate_stream` raises at its call. Cancelling the consuming task, or
        ``aclose()``, aborts the request: the loop frees its KV blocks before its next step.
        ``prompt_tokens`` holds the prompt's length once the first ``__anext__`` ran."""
        return AsyncEventStream(self, request, deadline)

    def generate(self, request: dict[str, Any] | GenerationRequest, *,
                 deadline: float | None = None) -> dict[str, Any]:
        """Run a request to completion; return ``text``, ``token_ids``, ``finish_reason``,
        the parsed answer (``content``, ``reasoning_content``, ``tool_calls``) and ``usage``.
        Thread-safe: requests from several threads run in one batch. An exception in the
        calling thread while it waits (``KeyboardInterrupt``) aborts the request.

        Raises:
            RequestError: a request the engine rejects.
            DeadlineExceeded: ``deadline`` (see :meth:`submit`) passed first.
            EngineLoopError: the engine failed or was closed.
        """
        p = self.prepare(request)
        answer = p.answer
        handle = self._submit(p, deadline)
        outputs = list(self._outputs(handle))
        text = "".join(out.text for out in outputs)
        answer.delta(text, final=True)
        seq = handle.seq
        assert seq is not None
        return make_response(text, list(seq.output_ids), answer.finish_reason(_finish_reason(seq)),
                             handle.prompt_tokens, len(seq.output_ids), seq.cached_tokens, **answer.whole(),
                             logprobs=self._logprobs(seq, [e for out in outputs for e in out.logprobs]),
                             stop_sequence=seq.stop_matcher.matched)


@attrs.frozen
class PreparedRequest:
    """A request ready for the engine loop (:meth:`Engine.prepare`).

    Attributes:
        request: the validated request.
        prompt_ids: its prompt's token ids.
        answer: its answer parser.
        constraint: its grammar matcher, or None.
        keep_special_ids: special tokens its text keeps (a chat format's markers).
    """

    request: GenerationRequest
    prompt_ids: list[int]
    answer: ChatAnswer
    constraint: TokenConstraint | None
    keep_special_ids: frozenset[int]


class EventStream(Iterator[dict[str, Any]]):
    """One request's events for a thread (:meth:`Engine.generate_stream`): an iterator whose
    ``close()`` — or its collection — aborts the request even before the first event."""

    def __init__(self, handle: RequestHandle, events: Iterator[dict[str, Any]]):
        self._handle, self._events = handle, events
        self.prompt_tokens = handle.prompt_tokens
        """The prompt's length in tokens."""

    def __next__(self) -> dict[str, Any]:
        return next(self._events)

    def close(self) -> None:
        """Abort the request unless it finished; return once its KV blocks are free."""
        self._handle.abort(wait=True)

    def __del__(self) -> None:
        self._handle.abort(wait=False)


class AsyncEventStream:
    """One request's events for a coroutine (:meth:`Engine.agenerate_stream`).

    Attributes:
        prompt_tokens: the prompt's length in tokens; None until the first ``__anext__``.
    """

    def __init__(self, engine: Engine, request: dict[str, Any] | GenerationRequest, deadline: float | None):
        self.prompt_tokens: int | None = None
        self._events = self._run(engine, request, deadline)

    def __aiter__(self) -> AsyncEventStream:
        return self

    def __anext__(self) -> Awaitable[dict[str, Any]]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        await self._events.aclose()

    async def _run(self, engine: Engine, request: dict[str, Any] | GenerationRequest,
                   deadline: float | None) -> AsyncGenerator[dict[str, Any], None]:
        req = request if isinstance(request, GenerationRequest) else engine.parse(request)
        # A grammar may take a while to compile (and the first builds the token table): off the event loop.
        p = await asyncio.to_thread(engine.prepare, req) if req.response_format is not None or req.forced_tools \
            else engine.prepare(req)
        answer = p.answer
        self.prompt_tokens = len(p.prompt_ids)
        handle = engine.loop.submit(req, p.prompt_ids, deadline, asyncio.get_running_loop(), constraint=p.constraint,
                                    keep_special_ids=p.keep_special_ids)
        try:
            await asyncio.wrap_future(handle.accepted)
            while True:
                out = await handle.aget()
                _check_expired(out)
                for event in _step_events(out, answer, engine._logprobs):
                    yield event
                if out.finished:
                    return
        finally:
            # Never wait here: a cancelled task must not block its event loop; the loop
            # thread frees the KV blocks before its next step.
            handle.abort(wait=False)


def _check_expired(out: StepOutput) -> None:
    """Raise DeadlineExceeded for the finished output of a sequence dropped at its deadline."""
    seq = out.seq
    if out.finished and seq.finish_reason in (EXPIRED_WAITING, EXPIRED_RUNNING):
        raise DeadlineExceeded(queued=seq.finish_reason == EXPIRED_WAITING, output_tokens=len(seq.output_ids))


def _step_events(out: StepOutput, answer: ChatAnswer,
                 logprobs: Callable[[Sequence, Any], list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """The stream events of one step output: a delta when it carries text or tokens; after
    the finished output, what the answer parser held back and the final event. ``logprobs``
    shapes a sequence's logprob entries (None when its request asked for none)."""
    events = []
    if out.text or out.token_ids:
        events.append(make_delta_event(out.text, list(out.token_ids), **answer.delta(out.text),
                                       logprobs=logprobs(out.seq, out.logprobs)))
    if out.finished:
        seq = out.seq
        last = answer.delta("", final=True)
        if last["content"] or last["reasoning_content"] or last["tool_calls"]:
            events.append(make_delta_event("", [], **last, logprobs=logprobs(seq, ())))
        events.append(make_final_event(answer.finish_reason(_finish_reason(seq)), len(seq.prompt_ids),
                                       len(seq.output_ids), seq.cached_tokens, **answer.whole(),
                                       stop_sequence=seq.stop_matcher.matched))
    return events


def _finish_reason(seq: Sequence) -> FinishReason:
    """The reason a sequence that ran to its end stopped: the scheduler sets ``stop`` or
    ``length`` (an expired or aborted one raises before its final event)."""
    assert seq.finish_reason in ("stop", "length"), seq.finish_reason
    return cast(FinishReason, seq.finish_reason)
