"""Which tokens run in the next step: continuous batching with chunked prefill.

Policy (vLLM's, with mixed batches):

- **Step.** One step carries a *Decode Round* — one token for every running sequence whose
  prompt is fully computed — plus at most one *prefill chunk* of the oldest running
  sequence that still has prompt tokens to compute (New Prefill, or Append Prefill after a
  reused prefix, an earlier chunk or a preemption). The chunk has
  ``min(max_prefill_tokens, max_batch_tokens - decodes)`` tokens, so a long prompt advances
  a chunk per step while the running streams keep getting a token per step.
- **Admission.** Between steps, when no running sequence is mid-prefill and fewer than
  ``max_num_seqs`` run, the head of the waiting queue (FIFO) is admitted if the KV blocks
  for its whole prompt fit in the free blocks plus what evicting the prefix cache would
  free. Otherwise it waits — running out of KV blocks queues requests, it never fails them.
- **Preemption under KV pressure** (vLLM's *recompute* preemption). Reserving a step's
  blocks first evicts parked prefix-cache entries (least recently used first). If that is not
  enough, the newest running sequence is preempted: its KV blocks are freed, it returns
  to the front of the waiting queue with its tokens so far, and when readmitted its prompt
  plus generated tokens are prefilled again; it resumes where it stopped. Its sampler's
  generator is untouched, so seeded sampling continues its stream; with
  ``runtime.batch_invariant`` the recomputed numbers are bit-identical too. The oldest
  sequence is never preempted for a newer one, so it always progresses. A prefill chunk
  that does not fit while decodes run is skipped for that step (decodes go first).
- **Limits.** A prompt needing more blocks than the whole pool is rejected when it is
  submitted (:meth:`Scheduler.check_fits`, a ``RequestError`` naming both sizes); a
  sequence stops with finish reason ``length`` when it fills the pool
  (:attr:`Scheduler.max_tokens_per_seq`). So :class:`~zllm.runtime.kv_cache.OutOfKVBlocks`
  never escapes a step, and no request fails because of another.
- **Deadlines.** Before each step, :meth:`Scheduler.expire` drops every sequence whose
  ``deadline`` (or the scheduler's ``drain_deadline``) has passed: a queued one leaves the
  queue without ever being prefilled, a running one is aborted and its KV blocks freed. Its
  owner learns it from that step's outputs (finish reason :data:`EXPIRED_WAITING` or
  :data:`EXPIRED_RUNNING`), so a request is
  answered within one step of its deadline even while it waits for admission.

:attr:`Scheduler.stats` counts what the steps contained (for tests and metrics).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs

from zllm.runtime.kv_cache import PagedKVCache, SeqKV
from zllm.runtime.sequence import SeqStatus, Sequence
from zllm.runtime.speculative import Proposal
from zllm.spec.errors import RequestError

EXPIRED_WAITING, EXPIRED_RUNNING = "expired_waiting", "expired_running"
"""``Sequence.finish_reason`` of a sequence dropped at its deadline while queued / running
(never a protocol's finish reason: the engine turns both into
:class:`~zllm.spec.errors.DeadlineExceeded`)."""


@attrs.frozen
class ScheduledStep:
    """The work of one step: ``(sequence, number of new tokens to compute)`` pairs — the
    Decode Round's ``num_decodes`` items first, then at most one prefill chunk — and, per
    item, the lookahead tokens (a speculative proposal) computed after its new tokens:
    ``lookahead[i]`` for ``items[i]``, None for most (``()`` = no item has any)."""

    items: tuple[tuple[Sequence, int], ...]
    num_decodes: int
    lookahead: tuple[Proposal | None, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.items[self.num_decodes:])


@attrs.define
class SchedulerStats:
    """Counters over every step a scheduler produced.

    Attributes:
        steps: steps scheduled.
        decode_tokens, prefill_tokens: tokens scheduled as decodes / in prefill chunks.
        mixed_steps: steps carrying a Decode Round and a prefill chunk together.
        max_decodes_per_step: the most sequences one Decode Round held.
        lookahead_tokens: speculative proposals scheduled (blocks reserved) after decodes.
        preemptions: running sequences preempted (KV freed, recomputed later).
        admission_waits: steps in which the queue head waited for KV blocks.
        expired_waiting, expired_running: sequences dropped at their deadline while queued
            (never prefilled) / while running (KV freed).
    """

    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    mixed_steps: int = 0
    max_decodes_per_step: int = 0
    lookahead_tokens: int = 0
    preemptions: int = 0
    admission_waits: int = 0
    expired_waiting: int = 0
    expired_running: int = 0


class PrefixCache:
    """Finished sequences whose KV is kept for reuse by a later request with the same prefix
    (multi-turn chat, shared system prompts). Least recently used entries go first."""

    def __init__(self, kv: PagedKVCache, capacity: int):
        self.kv, self.capacity = kv, capacity
        self._entries: OrderedDict[int, tuple[list[int], SeqKV]] = OrderedDict()
        self._next = 0

    def park(self, token_ids: list[int], seq_kv: SeqKV) -> None:
        """Keep ``seq_kv`` (which caches ``token_ids[:seq_kv.num_tokens]``) or free it.

        A sequence whose sliding window already freed blocks is freed, not parked: a later
        prompt sharing only part of it would need keys that are gone.
        """
        if self.capacity == 0 or seq_kv.num_tokens == 0 or seq_kv.num_evicted:
            self.kv.free(seq_kv)
            return
        self._entries[self._next] = (token_ids[: seq_kv.num_tokens], seq_kv)
        self._next += 1
        while len(self._entries) > self.capacity:
            self.evict_one()

    def take(self, prompt_ids: list[int]) -> tuple[SeqKV, int] | None:
        """The parked KV sharing the longest prefix with ``prompt_ids``, truncated to that
        prefix (at most ``len(prompt_ids) - 1`` so the last prompt token is computed and
        yields logits), and the prefix length; None if no entry shares a token."""
        best_key, best_len = None, 0
        for key, (ids, _) in self._entries.items():
            n = 0
            limit = min(len(ids), len(prompt_ids) - 1)
            while n < limit and ids[n] == prompt_ids[n]:
                n += 1
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            return None
        _, seq_kv = self._entries.pop(best_key)
        self.kv.truncate(seq_kv, best_len)
        return seq_kv, best_len

    @property
    def num_blocks(self) -> int:
        """Blocks held by parked entries (all freed by evicting every entry)."""
        return sum(sum(1 for b in kv.blocks if b >= 0) for _, kv in self._entries.values())

    def evict_one(self) -> bool:
        if not self._entries:
            return False
        _, (_, seq_kv) = self._entries.popitem(last=False)
        self.kv.free(seq_kv)
        return True


class Scheduler:
    """Queues of waiting and running sequences, and the step policy above.

    Args:
        kv: the engine's paged KV cache.
        max_num_seqs: sequences running at once.
        max_prefill_tokens: tokens per prefill chunk.
        prefix_cache_seqs: finished sequences parked for prefix reuse.
        max_batch_tokens: tokens per step (decodes + chunk); None = ``max_num_seqs + max_prefill_tokens``.
    """

    def __init__(self, kv: PagedKVCache, max_num_seqs: int, max_prefill_tokens: int, prefix_cache_seqs: int,
                 max_batch_tokens: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_batch_tokens = max_batch_tokens if max_batch_tokens is not None else max_num_seqs + max_prefill_tokens
        assert self.max_batch_tokens >= max_num_seqs, (self.max_batch_tokens, max_num_seqs)
        self.prefix_cache = PrefixCache(kv, prefix_cache_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._promised = 0
        # A monotonic time that bounds every sequence's deadline (set once by a draining
        # server from another thread; a float store is atomic, and the next expire reads it).
        self.drain_deadline: float | None = None

    @property
    def max_tokens_per_seq(self) -> int | None:
        """Tokens one sequence can hold when it has the whole pool (None: a sliding window
        frees old blocks, so the pool does not bound its length)."""
        return None if self.kv.sliding_window is not None else self.kv.num_blocks * self.kv.block_size

    def _blocks_for(self, num_tokens: int) -> int:
        blocks = -(-num_tokens // self.kv.block_size)
        if self.kv.sliding_window is not None:  # older blocks are freed as the prefill moves on
            blocks = min(blocks, -(-(self.kv.sliding_window + self.max_prefill_tokens) // self.kv.block_size) + 1)
        return blocks

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject a prompt the pool can never hold, whatever else runs.

        Raises:
            RequestError: naming the prompt's blocks and the pool's.
        """
        need = self._blocks_for(num_prompt_tokens)
        if need > self.kv.num_blocks:
            raise RequestError(
                "prompt",
                f"the prompt ({num_prompt_tokens} tokens) needs {need} KV cache blocks of {self.kv.block_size} tokens, "
                f"but the whole cache has {self.kv.num_blocks} blocks ({self.kv.num_blocks * self.kv.block_size} "
                f"tokens; runtime.kv_cache.num_blocks)",
            )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step's work, or None when idle."""
        self._promised = 0  # free blocks promised to this step's sequences so far
        prefilling = next((s for s in self.running if self._prefill_left(s)), None)
        if prefilling is None:
            admitted = self._admit()  # with a reused prefix of all but one token it decodes at once
            prefilling = admitted if admitted is not None and self._prefill_left(admitted) else None
        decodes = self._reserve_decodes([s for s in self.running if s is not prefilling])
        items: list[tuple[Sequence, int]] = [(s, 1) for s in decodes]
        if prefilling is not None and prefilling in self.running:
            n = min(self._prefill_left(prefilling), self.max_prefill_tokens, self.max_batch_tokens - len(decodes))
            n = self._fit_chunk(prefilling, n, preempt=not decodes)
            if n:
                items.append((prefilling, n))
        if not items:
            assert not self.running, "running sequences but nothing scheduled"
            return None
        step = ScheduledStep(tuple(items), len(decodes))
        st = self.stats
        st.steps += 1
        st.decode_tokens += len(decodes)
        st.prefill_tokens += step.prefill_tokens
        st.mixed_steps += bool(decodes and step.prefill_tokens)
        st.max_decodes_per_step = max(st.max_decodes_per_step, len(decodes))
        return step

    def add_lookahead(self, step: ScheduledStep, proposals: dict[int, Proposal]) -> ScheduledStep:
        """``step`` with each decode's proposal (by ``seq_id``) as its lookahead, cut to what
        the free KV blocks hold: speculation never evicts the prefix cache or preempts a
        sequence. Call right after :meth:`schedule`, whose promises it extends."""
        lookahead: list[Proposal | None] = []
        for i, (seq, n) in enumerate(step.items):
            proposal = proposals.get(seq.seq_id) if i < step.num_decodes else None
            size = 0 if proposal is None else len(proposal.tokens)
            own = self.kv.blocks_needed(seq.kv, n)  # already promised by schedule()
            while size and not self.kv.can_append(seq.kv, n + size, self._promised - own):
                size -= 1
            self._promised += self.kv.blocks_needed(seq.kv, n + size) - own
            lookahead.append(proposal.cut(size) if proposal is not None and size else None)
        self.stats.lookahead_tokens += sum(len(p.tokens) for p in lookahead if p is not None)
        return attrs.evolve(step, lookahead=tuple(lookahead)) if any(lookahead) else step

    @staticmethod
    def _prefill_left(seq: Sequence) -> int:
        """Tokens still to prefill (a decode-phase sequence has exactly 1 uncomputed token)."""
        left = seq.num_tokens - seq.num_computed
        return left if left > 1 or seq.num_computed == 0 else 0

    def _admit(self) -> Sequence | None:
        """Move the queue head to running if a slot is free and its prompt's blocks fit."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return None
        seq = self.waiting[0]
        if self._blocks_for(seq.num_tokens) > self.kv.num_free_blocks + self.prefix_cache.num_blocks:
            self.stats.admission_waits += 1
            return None
        self.waiting.popleft()
        if seq.num_computed == 0:
            reused = self.prefix_cache.take(seq.all_ids)
            if reused is not None:
                seq.kv, hit = reused
                # usage.cached_tokens counts prompt tokens served from the cache; a sequence
                # recomputed after preemption may also reuse its own generated tokens.
                if not seq.output_ids:
                    seq.cached_tokens = hit
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return seq

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Promise ``seq`` the blocks for ``n`` more tokens in the step being planned (the
        runner takes them), evicting prefix-cache entries as needed."""
        while not self.kv.can_append(seq.kv, n, self._promised):
            if not self.prefix_cache.evict_one():
                return False
        self._promised += self.kv.blocks_needed(seq.kv, n)
        return True

    def _reserve_decodes(self, decoding: list[Sequence]) -> list[Sequence]:
        """The decode-phase sequences that got a block for their next token, oldest first,
        preempting the newest running sequence while one is short."""
        for seq in decoding:
            while seq in self.running and not self._reserve(seq, 1):
                self._preempt(self.running[-1])
        return [s for s in decoding if s in self.running]

    def _fit_chunk(self, seq: Sequence, n: int, preempt: bool) -> int:
        """Tokens of a chunk of up to ``n`` that ``seq`` can get blocks for (0: skip it this
        step). With ``preempt`` (no decode this step) newer sequences make room."""
        while not self._reserve(seq, n):
            room = n - 1
            while room and not self.kv.can_append(seq.kv, room, self._promised):
                room -= 1
            if room:
                self._promised += self.kv.blocks_needed(seq.kv, room)
                return room
            newer = self.running[self.running.index(seq) + 1:]
            if not preempt or not newer:
                assert not preempt, "an admitted sequence alone cannot get its blocks"
                return 0
            self._preempt(newer[-1])
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.kv)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence; its KV goes to the prefix cache."""
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.prefix_cache.park(seq.all_ids, seq.kv)
        seq.kv = SeqKV()

    def expire(self, now: float) -> list[Sequence]:
        """Drop the sequences whose deadline is at or before ``now`` (:func:`time.monotonic`
        seconds): queued ones leave the queue unprefilled, running ones are aborted with
        their KV blocks freed; finish reason :data:`EXPIRED_WAITING` / :data:`EXPIRED_RUNNING`.

        Returns:
            The dropped sequences, queued ones first.
        """
        drain = self.drain_deadline

        def due(seq: Sequence) -> bool:
            deadline = seq.deadline if drain is None else min(drain, seq.deadline or drain)
            return deadline is not None and deadline <= now

        waiting = [s for s in self.waiting if due(s)]
        running = [s for s in self.running if due(s)]
        for seqs, reason in ((waiting, EXPIRED_WAITING), (running, EXPIRED_RUNNING)):
            for seq in seqs:
                self.abort(seq)
                seq.finish_reason = reason
        self.stats.expired_waiting += len(waiting)
        self.stats.expired_running += len(running)
        return waiting + running

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.kv)
        seq.status = SeqStatus.FINISHED
