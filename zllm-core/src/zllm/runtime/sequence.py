"""One generation request's state as the runtime sees it."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

import torch

from zllm.runtime.kv_cache import SeqKV
from zllm.runtime.stop import StopStringMatcher
from zllm.spec.request import GenerationRequest

if TYPE_CHECKING:
    from zllm.runtime.speculative import Lookahead


class TokenConstraint(Protocol):
    """What limits a sequence's tokens (a grammar's matcher, :mod:`zllm.runtime.grammar`).

    The runtime calls :meth:`allowed_tokens` before each of the sequence's tokens is sampled
    and :meth:`accept` with each token it keeps (a stop token that ends the sequence is not
    passed); a sequence whose constraint is :attr:`finished` ends with reason ``stop``.
    """

    def allowed_tokens(self) -> torch.Tensor | None:
        """The tokens allowed next — bool ``[V]`` or a packed int32 ``[ceil(V / 32)]``
        bitmask sized to the model's logits (:func:`zllm.runtime.sampler.apply_masks`) — or
        None for no limit at this token."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy at the same position: speculative decoding walks it over
        proposed tokens (each verify row's mask) and drops it."""
        ...

    @property
    def finished(self) -> bool:
        """Whether nothing may follow: the sequence ends without sampling an EOS."""
        ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request in flight: its tokens, KV handle, sampling state and stop rules.

    ``num_computed`` tokens of ``prompt_ids + output_ids`` are in the KV cache. A step
    computes the next tokens from there; when it reaches the end a new token is sampled. So
    a New Prefill, an Append Prefill (cached prefix or chunked prompt) and a Decode Round
    are the same operation on different spans.

    ``deadline`` is a :func:`time.monotonic` time (seconds) after which the scheduler drops
    the sequence, queued or running (:meth:`zllm.runtime.scheduler.Scheduler.expire`); None
    = no limit.

    ``constraint`` (a :class:`TokenConstraint`, e.g. a grammar's matcher) limits which tokens
    may be sampled; None = any.
    """

    def __init__(self, seq_id: int, request: GenerationRequest, prompt_ids: list[int], max_new_tokens: int,
                 stop_token_ids: frozenset[int], detokenizer, generator: torch.Generator,
                 constraint: TokenConstraint | None = None):
        self.seq_id = seq_id
        self.request = request
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.kv = SeqKV()
        self.cached_tokens = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.stop_matcher = StopStringMatcher(request.stop)
        self.generator = generator
        self.prompt_tensor = torch.tensor(prompt_ids, dtype=torch.int64)
        self.first_token_time: float | None = None
        self.deadline: float | None = None
        self.constraint = constraint
        self.lookahead: Lookahead | None = None  # how many tokens to propose (speculative decoding), or None

    @property
    def num_computed(self) -> int:
        return self.kv.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_span(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of ``prompt_ids + output_ids``."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(0, start - p): end - p]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
