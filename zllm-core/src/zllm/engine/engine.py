"""``zllm.Engine``: the in-process API with the same request/response JSON as the server.

Thread safety: one lock serialises steps, so several threads (e.g. server handlers) may
each drive ``generate``/``generate_stream``; whichever thread steps delivers every
sequence's outputs to its owner's queue.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from zllm.domain.family import model_kv_spec
from zllm.engine.chat_output import ChatAnswer, output_parser
from zllm.engine.loader import LoadedModel, kv_cache_dtype, load_model
from zllm.engine.tool_parsers import resolve_format
from zllm.plugins.host import PluginHost
from zllm.runtime.kv_cache import PagedKVCache
from zllm.runtime.llm_engine import LLMEngine, StepOutput
from zllm.runtime.scheduler import EXPIRED_RUNNING, EXPIRED_WAITING
from zllm.runtime.sequence import Sequence
from zllm.spec.config import ZllmConfig, config_from_dict, load_config
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


class Engine:
    """A loaded model ready to generate. Build it with :meth:`from_config`."""

    def __init__(self, loaded: LoadedModel, host: PluginHost):
        self.loaded, self.host = loaded, host
        cfg = loaded.config
        kv_spec = model_kv_spec(loaded.model)
        num_blocks = loaded.kv_num_blocks
        block_size = cfg.runtime.kv_cache.block_size
        dtype = kv_cache_dtype(cfg)
        try:
            kv = PagedKVCache(kv_spec, num_blocks, block_size, dtype=dtype, device=loaded.backend.device)
        except (RuntimeError, MemoryError) as exc:  # torch reports a failed allocation as RuntimeError
            key = "num_blocks" if cfg.runtime.kv_cache.num_blocks else "block_size"
            nbytes = num_blocks * kv_spec.block_bytes(block_size, dtype.itemsize)
            raise ConfigError(
                f"runtime.kv_cache.{key}",
                f"{num_blocks} KV blocks of {block_size} tokens need {nbytes / 2**30:.1f} GiB, which cannot "
                f"be allocated on {loaded.backend.device}",
            ) from exc
        self.llm = LLMEngine(
            loaded.model, loaded.ops, loaded.tokenizer, kv, loaded.eos_token_ids,
            max_num_seqs=cfg.runtime.max_num_seqs, max_prefill_tokens=cfg.runtime.max_prefill_tokens,
            prefix_cache_seqs=cfg.runtime.prefix_cache_seqs, context_length=loaded.context_length,
            device=loaded.backend.device, max_batch_tokens=cfg.runtime.max_batch_tokens,
            batch_invariant=cfg.runtime.batch_invariant,
        )
        self._lock = threading.Lock()
        self._queues: dict[int, deque[StepOutput]] = {}
        self.tool_format = resolve_format(cfg.server.tool_parser, loaded.tokenizer.chat_template)
        """The chat format tool calls are read in (``server.tool_parser``), or None."""

    @classmethod
    def from_config(cls, config: ZllmConfig | Mapping[str, Any] | str | os.PathLike[str], *, host: PluginHost | None = None,
                    on_tensor: Callable[[str, int], None] | None = None,
                    on_start: Callable[[int], None] | None = None) -> Engine:
        """Load the model a config names.

        Args:
            config: a :class:`ZllmConfig`, a config mapping (as a parsed YAML file; a relative
                ``model.path`` is taken from the current directory) or the path of a YAML file.
            host: a plugin host; default discovers installed plugins, honouring ``ZLLM_PLUGINS``.
            on_start, on_tensor: load-progress callbacks (total bytes; each tensor).

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
            raise ConfigError("", f"expected a ZllmConfig, a config mapping or a YAML file path, got {type(config).__name__}")
        host = host or PluginHost(allowlist=plugin_allowlist_from_env())
        return cls(load_model(cfg, host, on_tensor=on_tensor, on_start=on_start), host)

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

    def submit(self, request: dict[str, Any] | GenerationRequest, *, deadline: float | None = None) -> Sequence:
        """Validate, tokenize and queue a request; return its sequence handle.

        ``deadline``: a :func:`time.monotonic` time after which the runtime drops the request,
        queued or running, within one step (its outputs then raise :class:`DeadlineExceeded`).
        """
        req = request if isinstance(request, GenerationRequest) else self.parse(request)
        ids = self.prompt_ids(req)
        with self._lock:
            seq = self.llm.add_request(req, ids, req.max_tokens)
            seq.deadline = deadline
            self._queues[seq.seq_id] = deque()
        return seq

    def drain(self, deadline: float) -> None:
        """Bound every request's deadline, queued, running or submitted later, by ``deadline``
        (:func:`time.monotonic` seconds): a server shutting down ends what is left then.
        Callable from any thread without the engine lock (one attribute store)."""
        self.llm.scheduler.drain_deadline = deadline

    def _outputs(self, seq: Sequence) -> Iterator[StepOutput]:
        """This sequence's step outputs, stepping the engine as needed."""
        queue = self._queues[seq.seq_id]
        try:
            while True:
                while queue:
                    out = queue.popleft()
                    if seq.finish_reason in (EXPIRED_WAITING, EXPIRED_RUNNING):
                        raise DeadlineExceeded(queued=seq.finish_reason == EXPIRED_WAITING,
                                               output_tokens=len(seq.output_ids))
                    yield out
                    if out.finished:
                        return
                with self._lock:
                    if not queue:
                        for out in self.llm.step():
                            self._queues[out.seq.seq_id].append(out)
        finally:
            with self._lock:
                if seq.finish_reason is None:
                    self.llm.abort(seq)
                self._queues.pop(seq.seq_id, None)

    def prompt_logits(self, prompt_ids: list[int]):
        """f32 ``[P, V]`` logits at every position of ``prompt_ids`` (for scoring and parity tests)."""
        with self._lock:
            return self.llm.prompt_logits(list(prompt_ids))

    def generate_stream(self, request: dict[str, Any] | GenerationRequest, *,
                        deadline: float | None = None) -> Iterator[dict[str, Any]]:
        """Stream events: one per step that produced output (``text`` delta and
        ``token_ids``), then a final event with ``finish_reason`` and ``usage``.
        Closing the iterator early aborts the request and frees its KV cache.
        A chat request's deltas carry its answer parsed (``content``, ``reasoning_content``,
        ``tool_calls`` pieces) and the final event the whole of it; a last delta without
        tokens may carry what the parser held back.

        Raises:
            DeadlineExceeded: from the iterator, once ``deadline`` (see :meth:`submit`) passed.
        """
        req = request if isinstance(request, GenerationRequest) else self.parse(request)
        answer = ChatAnswer(output_parser(self.tool_format, self.tokenizer, req))
        seq = self.submit(req, deadline=deadline)
        return self._stream_events(seq, answer)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs: "" for a padded logits column outside the vocabulary."""
        if token_id >= self.tokenizer.vocab_size:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, seq: Sequence, entries) -> list[dict[str, Any]] | None:
        return None if seq.request.logprobs is None else make_logprobs(entries, self.token_text)

    def _stream_events(self, seq: Sequence, answer: ChatAnswer) -> Iterator[dict[str, Any]]:
        for out in self._outputs(seq):
            if out.text or out.token_ids:
                yield make_delta_event(out.text, list(out.token_ids), **answer.delta(out.text),
                                       logprobs=self._logprobs(seq, out.logprobs))
        last = answer.delta("", final=True)
        if last["content"] or last["reasoning_content"] or last["tool_calls"]:
            yield make_delta_event("", [], **last, logprobs=self._logprobs(seq, ()))
        yield make_final_event(answer.finish_reason(_finish_reason(seq)), len(seq.prompt_ids), len(seq.output_ids),
                               seq.cached_tokens, **answer.whole())

    def generate(self, request: dict[str, Any] | GenerationRequest, *,
                 deadline: float | None = None) -> dict[str, Any]:
        """Run a request to completion; return ``text``, ``token_ids``, ``finish_reason``,
        the parsed answer (``content``, ``reasoning_content``, ``tool_calls``) and ``usage``.

        Raises:
            DeadlineExceeded: ``deadline`` (see :meth:`submit`) passed first.
        """
        req = request if isinstance(request, GenerationRequest) else self.parse(request)
        answer = ChatAnswer(output_parser(self.tool_format, self.tokenizer, req))
        seq = self.submit(req, deadline=deadline)
        outputs = list(self._outputs(seq))
        text = "".join(out.text for out in outputs)
        answer.delta(text, final=True)
        return make_response(text, list(seq.output_ids), answer.finish_reason(_finish_reason(seq)),
                             len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens, **answer.whole(),
                             logprobs=self._logprobs(seq, [e for out in outputs for e in out.logprobs]))


def _finish_reason(seq: Sequence) -> FinishReason:
    """The reason a sequence that ran to its end stopped: the scheduler sets ``stop`` or
    ``length`` (an expired or aborted one raises before its final event)."""
    assert seq.finish_reason in ("stop", "length"), seq.finish_reason
    return cast(FinishReason, seq.finish_reason)
