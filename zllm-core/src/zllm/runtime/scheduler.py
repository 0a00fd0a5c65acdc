"""Which tokens run in the next step: prefill chunks first, then Decode Rounds.

Policy (vLLM's default, without mixed batches): if a sequence still has prompt tokens to
compute, the step is a prefill of up to ``max_prefill_tokens`` of them (New Prefill, or
Append Prefill when part of the sequence is already cached — a reused prefix or an earlier
chunk). Otherwise the step is a Decode Round: one token for every running sequence. A new
request is admitted while fewer than ``max_num_seqs`` run. When a Decode Round cannot get
KV blocks, parked prefix-cache entries are evicted first, then the newest running sequence
is preempted: its KV is freed and it is recomputed later (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs

from zllm.runtime.kv_cache import OutOfKVBlocks, PagedKVCache, SeqKV
from zllm.runtime.sequence import Sequence, SeqStatus


@attrs.frozen
class ScheduledStep:
    """The work of one step: ``(sequence, number of new tokens to compute)`` pairs."""

    items: tuple[tuple[Sequence, int], ...]
    is_prefill: bool


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

    def evict_one(self) -> bool:
        if not self._entries:
            return False
        _, (_, seq_kv) = self._entries.popitem(last=False)
        self.kv.free(seq_kv)
        return True


class Scheduler:
    """Queues of waiting and running sequences, and the step policy above."""

    def __init__(self, kv: PagedKVCache, max_num_seqs: int, max_prefill_tokens: int, prefix_cache_seqs: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = PrefixCache(kv, prefix_cache_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step's work, or None when idle."""
        for seq in self.running:
            if seq.num_tokens - seq.num_computed > 1:  # a prefill chunk left (or recompute)
                return self._prefill(seq)
        if self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.num_computed == 0:
                reused = self.prefix_cache.take(seq.all_ids)
                if reused is not None:
                    seq.kv, seq.cached_tokens = reused
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            return self._prefill(seq)
        if not self.running:
            return None
        return self._decode()

    def _reserve(self, seq: Sequence, n: int) -> bool:
        while not self.kv.can_append(seq.kv, n):
            if not self.prefix_cache.evict_one():
                return False
        return True

    def _prefill(self, seq: Sequence) -> ScheduledStep:
        n = min(seq.num_tokens - seq.num_computed, self.max_prefill_tokens)
        if not self._reserve(seq, n):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                raise OutOfKVBlocks(
                    f"KV cache too small for one sequence: {seq.num_tokens} tokens need "
                    f"{-(-seq.num_tokens // self.kv.block_size)} blocks, the pool has {self.kv.num_blocks}"
                )
            self._preempt(victims[-1])
            return self._prefill(seq)
        return ScheduledStep(((seq, n),), True)

    def _decode(self) -> ScheduledStep:
        for seq in list(self.running):
            if seq in self.running and not self._reserve(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is not seq and not self._reserve(seq, 1):
                    self._preempt(seq)
        return ScheduledStep(tuple((s, 1) for s in self.running), False) if self.running else self.schedule()

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.kv)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence; its KV goes to the prefix cache."""
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.prefix_cache.park(seq.all_ids, seq.kv)
        seq.kv = SeqKV()

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.kv)
        seq.status = SeqStatus.FINISHED
