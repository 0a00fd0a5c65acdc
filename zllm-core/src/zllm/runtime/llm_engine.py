"""The runtime loop: admit requests, run steps, apply stop rules, emit outputs.

This is the one execution flow every entry point (CLI, ``zllm.Engine``, the HTTP server)
drives: ``add_request`` then ``step`` until the request reports ``finished``.
"""

from __future__ import annotations

import itertools
import secrets
import time

import attrs
import torch

from zllm.runtime.kv_cache import PagedKVCache
from zllm.runtime.runner import ModelRunner, Sampled
from zllm.runtime.sampler import TokenLogprob, allows
from zllm.runtime.scheduler import ScheduledStep, Scheduler
from zllm.runtime.sequence import Sequence, TokenConstraint
from zllm.runtime.speculative import HiddenStateProposer, Lookahead, Proposer, SpecStats
from zllm.spec.errors import ContextLengthError, RequestError
from zllm.spec.request import GenerationRequest
from zllm.tokenizer import IncrementalDetokenizer


def _grammar_prefix(constraint: TokenConstraint, tokens: list[int]) -> int:
    """How many of ``tokens`` the constraint allows in a row, ending at one that completes it
    (a token after a disallowed or final one could never be accepted)."""
    walk = constraint.fork()
    for i, token in enumerate(tokens):
        mask = walk.allowed_tokens()
        if mask is not None and not allows(mask, token):
            return i
        walk.accept(token)
        if walk.finished:
            return i + 1
    return len(tokens)


@attrs.frozen
class StepOutput:
    """What one step produced for one sequence.

    Attributes:
        seq: the sequence.
        text: newly released text (may be empty while a stop string or a multi-byte
            character is held back).
        token_ids: tokens that belong to the output from this step (a stop token is not one).
        finished: True on the sequence's last output; ``seq.finish_reason`` is then set.
        logprobs: one entry per ``token_ids`` entry when the request asked for logprobs,
            else empty.
    """

    seq: Sequence
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    logprobs: tuple[TokenLogprob, ...] = ()


class LLMEngine:
    """Drives one model on one backend.

    Args:
        model: a built model (see ``zllm.domain.family.Model``).
        ops: the model's bound kernels.
        tokenizer: a ``zllm.tokenizer.Tokenizer``.
        kv: the paged KV cache sized for this model.
        eos_token_ids: ids that end generation (from generation config / GGUF / config).
        max_num_seqs, max_prefill_tokens, prefix_cache_seqs, max_batch_tokens: scheduler
            settings (``zllm.runtime.scheduler``).
        context_length: the context window in tokens.
        device: where batch tensors go.
        batch_invariant: sample each row on its own (config ``runtime.batch_invariant``).
        proposer, num_speculative_tokens, adaptive_lookahead: speculative decoding
            (:mod:`zllm.runtime.speculative`): who proposes, the most proposals per step, and
            whether each sequence adapts that number to its acceptance; no proposer = none.
    """

    def __init__(self, model, ops, tokenizer, kv: PagedKVCache, eos_token_ids: frozenset[int], *,
                 max_num_seqs: int, max_prefill_tokens: int, prefix_cache_seqs: int, context_length: int,
                 device: torch.device, max_batch_tokens: int | None = None, batch_invariant: bool = False,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0, adaptive_lookahead: bool = True):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.sample_width = min(model.vocab_size, tokenizer.vocab_size)
        """Logits columns tokens are sampled from (a padded vocabulary's extra columns are not)."""
        self.runner = ModelRunner(model, ops, kv, device, batch_invariant, self.sample_width)
        self.scheduler = Scheduler(kv, max_num_seqs, max_prefill_tokens, prefix_cache_seqs, max_batch_tokens)
        self._ids = itertools.count()
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive_lookahead = adaptive_lookahead
        self.spec_stats = SpecStats()
        """Proposals made and accepted per draft position (``zllm.runtime.speculative``)."""

    def add_request(self, request: GenerationRequest, prompt_ids: list[int], max_new_tokens: int, *,
                    constraint: TokenConstraint | None = None,
                    keep_special_ids: frozenset[int] = frozenset()) -> Sequence:
        """Queue a request whose prompt is already tokenized.

        ``constraint`` limits the sequence's tokens (a grammar's matcher); ``keep_special_ids``
        are special tokens its text keeps (a chat format's markers).

        Raises:
            RequestError: empty prompt or a token id outside the vocabulary.
            ContextLengthError: the prompt leaves no room in the context window for a token.
            RequestError: the prompt needs more KV blocks than the whole cache has.
        """
        if not prompt_ids:
            raise RequestError("prompt", "the prompt is empty after tokenization (and no BOS token is added)")
        vocab = self.runner.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError("prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthError(len(prompt_ids), self.context_length, generating=True)
        self.scheduler.check_fits(len(prompt_ids))
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        seq = Sequence(
            next(self._ids), request, list(prompt_ids), max_new_tokens,
            # ignore_eos (vLLM's switch, for benchmarks) keeps only the request's own stop ids
            (frozenset() if request.ignore_eos else self.eos_token_ids) | frozenset(request.stop_token_ids),
            IncrementalDetokenizer(self.tokenizer, prompt_ids=list(prompt_ids), keep_special_ids=keep_special_ids),
            generator, constraint,
        )
        if self.proposer is not None:
            seq.lookahead = Lookahead(self.num_speculative_tokens, self.adaptive_lookahead)
        self.scheduler.add(seq)
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one step; return the outputs it produced: first one finished output (no
        tokens, finish reason ``expired``) per sequence whose deadline had passed, then the
        step's tokens."""
        outputs = [StepOutput(seq, "", (), True) for seq in self.scheduler.expire(time.monotonic())]
        if self.proposer is not None:
            for out in outputs:
                self.proposer.release(out.seq)
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return outputs
        if self.proposer is not None and scheduled.num_decodes:
            scheduled = self._propose(scheduled)
        observer = self.proposer if isinstance(self.proposer, HiddenStateProposer) else None
        self.runner.keep_hidden = observer is not None
        now = time.perf_counter()
        for sampled in self.runner.execute(scheduled):
            if sampled.seq.first_token_time is None:
                sampled.seq.first_token_time = now
            outputs.append(self._accept(sampled))
        if observer is not None:
            observer.observe(self.runner.hidden_rows)
        return outputs

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _propose(self, step: ScheduledStep) -> ScheduledStep:
        """``step`` with proposals for its decodes: as many as each sequence's lookahead
        asks, never past its ``max_tokens`` or the context window (the step's own token comes
        after them); a sequence under a grammar keeps the prefix its grammar allows.

        None before a sequence's first output token: that token is drawn as a plain sample
        whether the last prompt token is computed in a prefill or — after a prefix-cache hit
        — in a decode, so a seeded request draws the same tokens with or without a cache hit."""
        assert self.proposer is not None
        seqs = [seq for seq, _ in step.items[: step.num_decodes]]
        ks = []
        for seq in seqs:
            room = min(seq.max_new_tokens - len(seq.output_ids), self.context_length - seq.num_tokens) - 1
            ks.append(0 if seq.lookahead is None or room <= 0 or not seq.output_ids
                      else min(seq.lookahead.next_k(), room))
        if not any(ks):
            return step
        proposals = self.proposer.propose(seqs, ks)
        wanted = {}
        for seq, proposal, k in zip(seqs, proposals, ks, strict=True):
            n = min(k, len(proposal.tokens))
            if n and seq.constraint is not None:
                n = _grammar_prefix(seq.constraint, proposal.tokens[:n])
            if n:
                wanted[seq.seq_id] = proposal.cut(n)
        return self.scheduler.add_lookahead(step, wanted)

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """f32 ``[P, V]`` logits at every prompt position (one New Prefill; vLLM's
        ``prompt_logprobs``). Runs outside the scheduler and frees its KV at once.

        Raises:
            ContextLengthError: the prompt is longer than the context window.
            OutOfKVBlocks: the KV cache cannot hold the prompt right now.
        """
        if len(prompt_ids) > self.context_length:
            raise ContextLengthError(len(prompt_ids), self.context_length)
        return self.runner.prompt_logits(prompt_ids)

    def _accept(self, sampled: Sampled) -> StepOutput:
        """Apply a step's tokens for one sequence in order; the first that ends it (a stop
        token, a stop string, a finished grammar, the length limits) drops the rest."""
        seq = sampled.seq
        if sampled.proposed:
            accepted = len(sampled.token_ids) - 1
            self.spec_stats.record(sampled.proposed, accepted)
            if seq.lookahead is not None:
                seq.lookahead.update(sampled.proposed, accepted)
        texts: list[str] = []
        kept: list[int] = []
        for token in sampled.token_ids:
            if token in seq.stop_token_ids:
                return self._finish(seq, "stop", "".join(texts), tuple(kept), sampled.logprobs[: len(kept)])
            seq.output_ids.append(token)
            kept.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            text, stopped = seq.stop_matcher.feed(seq.detokenizer.push([token]))
            texts.append(text)
            logprobs = sampled.logprobs[: len(kept)]
            if stopped:
                return self._finish(seq, "stop", "".join(texts), tuple(kept), logprobs, flush=False)
            if seq.constraint is not None and seq.constraint.finished:  # complete: no EOS step needed
                return self._finish(seq, "stop", "".join(texts), tuple(kept), logprobs)
            cap = self.scheduler.max_tokens_per_seq  # a sequence that fills the whole KV pool stops there
            if (len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.context_length
                    or (cap is not None and seq.num_tokens >= cap)):
                return self._finish(seq, "length", "".join(texts), tuple(kept), logprobs)
        return StepOutput(seq, "".join(texts), tuple(kept), False, sampled.logprobs)

    def _finish(self, seq: Sequence, reason: str, text: str, token_ids: tuple[int, ...],
                logprobs: tuple[TokenLogprob, ...] = (), flush: bool = True) -> StepOutput:
        """End ``seq``. Unless a stop string ended it, release what was held back: an
        incomplete UTF-8 tail and a tail that only looked like the start of a stop string
        (a stop string completed by that tail ends it as ``stop``)."""
        if flush:
            tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
            text += tail if stopped else tail + seq.stop_matcher.flush()
            reason = "stop" if stopped else reason
        seq.finish_reason = reason
        if seq.kv.num_tokens > seq.num_tokens:  # a verify step ended inside its accepted run
            self.scheduler.kv.truncate(seq.kv, seq.num_tokens)
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        return StepOutput(seq, text, token_ids, True, logprobs)
