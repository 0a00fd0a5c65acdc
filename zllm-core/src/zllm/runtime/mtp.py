"""Multi-token-prediction proposals: the target model's own MTP layer drafts its continuation.

DeepSeek-V3 (arXiv:2412.19437 §2.2) trains a small module next to the model: at position
``i`` it combines the model's hidden state ``h_i`` with the embedding of the token
``t_{i+1}`` and, through one decoder layer attending over such rows of earlier positions,
predicts ``t_{i+2}``. Serving uses it as a speculative proposer (the report's §5.4.3, vLLM's
and SGLang's ``deepseek_mtp``): this module drives any model's
:class:`~zllm.domain.family.MultiTokenPredictor`; the math is the family's.

Bookkeeping, per sequence (Dimension legend: C hidden size, S sequences, V vocabulary):

- **Its own paged KV cache.** The MTP layer's row for position ``i`` needs ``h_i`` (from the
  target's step) and ``t_{i+1}`` (known only once that step's token is accepted). After every
  step the engine hands over the kept hidden rows (:meth:`MtpProposer.observe`: prefill
  chunks and the accepted part of a verify step, never a rejected row) and one batched MTP
  forward appends their rows, so the MTP cache holds positions up to ``num_tokens - 2``,
  in step with the target's cache, and its output at the last of them predicts the first
  proposal.
- **Recursion for K > 1.** With one MTP layer, proposal ``j + 1`` applies the same layer
  again to its own output hidden state and proposal ``j`` (vLLM's choice for
  ``num_nextn_predict_layers = 1``; DeepSeek trained the module for one token ahead, so later
  proposals are accepted less often — the adaptive lookahead shortens them). Those rows are
  speculative: they are rolled back before :meth:`MtpProposer.propose` returns, and the next
  ``observe`` writes the true rows from the target's hidden states.
- **Gaps.** A prefix-cache hit skips positions whose hidden states the target never
  computed for this sequence; the MTP cache then restarts at the first position it sees
  (``offset``) and attends over what it has. Entry ``j`` is placed at rotary position ``j``
  (not ``offset + j``): RoPE scores depend only on the distance between positions, so the
  shift changes nothing but keeps every position below the cache's length. Recomputation
  after a preemption truncates the MTP cache to the recomputed position.
- **Drafts are greedy** (the argmax of the MTP logits over the sampled vocabulary) and
  carry no distribution (``q`` one-hot), as vLLM's MTP proposer: verification stays exact
  for sampled requests, only their acceptance is lower.

Drafts ignore a sequence's grammar: the engine keeps the prefix the grammar allows. A
sequence whose MTP cache cannot grow (its pool is sized to the target's, so only under
extreme preemption) is dropped and restarts at its next step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import attrs
import torch

from zllm.capabilities.ops import AttentionMetadata
from zllm.domain.family import MultiTokenPredictor
from zllm.runtime.kv_cache import OutOfKVBlocks, PagedKVCache, SeqKV
from zllm.runtime.sequence import SeqStatus, Sequence
from zllm.runtime.speculative import HiddenRows, Proposal


@attrs.define(eq=False)
class _Track:
    """One sequence's MTP state: ``kv`` holds the rows of positions ``offset ..
    offset + kv.num_tokens - 1``; ``last`` ``[C]`` is the layer's output at the last one."""

    seq: Sequence
    kv: SeqKV = attrs.Factory(SeqKV)
    offset: int = 0
    last: torch.Tensor | None = None


class MtpProposer:
    """Proposes with a model's multi-token-prediction layer (see the module doc).

    Args:
        mtp: the model's :class:`~zllm.domain.family.MultiTokenPredictor`.
        kv: the MTP layer's own paged cache (built from ``mtp.kv_spec``).
        device: where batch tensors go (the model's device).
        vocab_limit: drafts are drawn from the first ``vocab_limit`` logits columns (the
            tokens the sampler may produce; a padded vocabulary's extra columns are not).
    """

    name = "mtp"

    def __init__(self, mtp: MultiTokenPredictor, kv: PagedKVCache, device: torch.device, vocab_limit: int):
        self.mtp, self.kv, self.device, self.vocab_limit = mtp, kv, device, vocab_limit
        self._tracks: dict[int, _Track] = {}

    def observe(self, rows: Seq[HiddenRows]) -> None:
        """Append the MTP rows of every kept target row whose next token is known, all
        sequences in one forward, and keep each sequence's last output."""
        for seq_id in [i for i, t in self._tracks.items() if t.seq.status is not SeqStatus.RUNNING]:
            self._drop(seq_id)  # preempted: recomputed from its first position when readmitted
        tracks: list[_Track] = []
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        hidden: list[torch.Tensor] = []
        for r in rows:
            seq = r.seq
            if seq.finish_reason is not None:
                continue
            ids = seq.all_ids
            n = min(r.hidden.shape[0], len(ids) - 1 - r.start)  # rows whose next token is known
            if n <= 0:
                continue
            track = self._tracks.setdefault(seq.seq_id, _Track(seq, offset=r.start))
            end = track.offset + track.kv.num_tokens
            if r.start < track.offset or r.start > end:  # before what it holds, or a gap: restart
                self.kv.free(track.kv)
                track.offset = r.start
            else:  # recomputed rows (after a preemption) replace what it holds from there
                self.kv.truncate(track.kv, r.start - track.offset)
            first = track.kv.num_tokens
            try:
                slots += self.kv.append(track.kv, n)
            except OutOfKVBlocks:
                self._drop(seq.seq_id)
                continue
            tracks.append(track)
            tokens += ids[r.start + 1: r.start + 1 + n]
            positions += range(first, first + n)
            hidden.append(r.hidden[:n])
        if not tracks:
            return
        with torch.inference_mode():
            out = self._forward(tracks, tokens, torch.cat(hidden), positions, slots,
                                tuple(h.shape[0] for h in hidden))  # [S, C]
        for i, track in enumerate(tracks):
            track.last = out[i]

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Proposal]:
        """Up to ``ks[i]`` greedy drafts for each sequence whose MTP cache is in step with it
        (none for the others); every row the recursion appends is rolled back."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [(i, self._tracks[s.seq_id], k) for i, (s, k) in enumerate(zip(seqs, ks, strict=True))
                  if k > 0 and self._in_step(s)]
        if active:
            synced = [(t, t.kv.num_tokens) for _, t, _ in active]
            try:
                with torch.inference_mode():
                    self._recurse(active, drafts)
            finally:
                for track, n in synced:
                    self.kv.truncate(track.kv, n)
        return [Proposal(d) for d in drafts]

    def release(self, seq: Sequence) -> None:
        """Free the sequence's MTP cache."""
        self._drop(seq.seq_id)

    def _in_step(self, seq: Sequence) -> bool:
        """Whether the MTP cache holds positions up to ``num_tokens - 2`` and its last output
        predicts the token after the sequence's last."""
        track = self._tracks.get(seq.seq_id)
        return (track is not None and track.last is not None
                and track.offset + track.kv.num_tokens == seq.num_tokens - 1)

    def _recurse(self, active: list[tuple[int, _Track, int]], drafts: list[list[int]]) -> None:
        """Draft ``k`` tokens per active ``(index, track, k)``: the argmax of the layer's
        logits, then the layer again on its own output and that draft, one row per sequence."""
        hidden = torch.stack([t.last for _, t, _ in active if t.last is not None])  # [S, C]
        j = 0
        while True:
            logits = self.mtp.logits(hidden)[:, : self.vocab_limit]  # [S, V]
            chosen = torch.argmax(logits, dim=-1).tolist()
            for (i, _, _), token in zip(active, chosen, strict=True):
                drafts[i].append(token)
            j += 1
            keep = [n for n, (_, _, k) in enumerate(active) if k > j]
            if not keep:
                return
            slots: list[int] = []
            try:
                for n in keep:
                    slots += self.kv.append(active[n][1].kv, 1)
            except OutOfKVBlocks:  # the rows appended so far are rolled back by the caller
                return
            active = [active[n] for n in keep]
            tracks = [t for _, t, _ in active]
            hidden = self._forward(tracks, [chosen[n] for n in keep], hidden[keep],
                                   [t.kv.num_tokens - 1 for t in tracks], slots, (1,) * len(keep))

    def _forward(self, tracks: list[_Track], tokens: list[int], hidden: torch.Tensor, positions: list[int],
                 slots: list[int], query_lens: tuple[int, ...]) -> torch.Tensor:
        """One MTP forward over a flattened batch whose slots are reserved; ``[S, C]`` outputs
        at each sequence's last row."""
        t = len(tokens)
        rows = [sum(query_lens[: i + 1]) - 1 for i in range(len(query_lens))]
        table, width = self.kv.block_table_rows([tr.kv for tr in tracks])
        # One host list -> one int64 tensor: [ids T | positions T | slots T | rows S | block table S*MB].
        packed = torch.tensor(tokens + positions + slots + rows + table, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=packed[2 * t: 3 * t],
            block_tables=packed[3 * t + len(rows):].view(len(tracks), width),
            query_lens=query_lens,
            context_lens=tuple(tr.kv.num_tokens for tr in tracks),
            scale=self.kv.spec.attention_scale,
        )
        return self.mtp.forward(packed[:t], hidden, packed[t: 2 * t], meta, self.kv.layers,
                                packed[3 * t: 3 * t + len(rows)])

    def _drop(self, seq_id: int) -> None:
        track = self._tracks.pop(seq_id, None)
        if track is not None:
            self.kv.free(track.kv)
