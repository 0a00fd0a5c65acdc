"""Draft-model proposals (Leviathan et al. 2023; Chen et al. 2023; vLLM's and llama.cpp's
``speculative``): a smaller model with the target's tokenizer decodes ``k`` tokens ahead.

The draft keeps its own paged KV cache and its own :class:`~zllm.runtime.runner.ModelRunner`.
Its per-sequence state is synchronised lazily: at each :meth:`DraftProposer.propose` the
tokens the draft has cached for a sequence are compared with ``seq.all_ids``, the cache is
rolled back to their common prefix and the rest is prefilled. So rejected proposals,
preemption and anything else that changed the sequence since the last call cost no
bookkeeping elsewhere. Every draft step is one forward over all the sequences that still
want a token (``max(k)`` forwards per call).

Greedy rows propose the draft's argmax (after the request's penalties); sampled rows draw
from the draft's distribution after the request's sampling settings, which they return as
:attr:`Proposal.q`, with a generator of their own seeded from the sequence's seed, so a
seeded request stays reproducible and the target's generator sees only the target's draws.

A sequence under a grammar gets no ``q``: the runtime cuts its proposal before the first
token the grammar forbids, and then takes the next token from ``p`` rather than from the
residual ``norm(max(0, p - q))`` a rejection would use, which is only exact when the
proposal is verified as one-hot (a proposal drawn independently of the target's randomness
and verified as one-hot keeps every token distributed as ``p``; ``q`` only raises the
acceptance rate).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from zllm.runtime.kv_cache import SeqKV
from zllm.runtime.runner import GREEDY_BELOW, ModelRunner
from zllm.runtime.sequence import Sequence
from zllm.runtime.speculative import Proposal

#: Mixed into a sequence's seed to seed its draft generator (any fixed odd 63-bit constant).
DRAFT_SEED_SALT = 0x2545F4914F6CDD1D


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DraftProposer:
    """Proposes with a draft model (see the module doc).

    Args:
        runner: the draft model's runner, with its own KV cache, whose ``sample_width`` is the
            target's (proposals and their ``q`` cover exactly the target's sampled columns).
    """

    name = "draft"

    def __init__(self, runner: ModelRunner):
        assert runner.sample_width is not None
        self.runner = runner
        self.kv = runner.kv
        self._handles: dict[int, SeqKV] = {}
        self._cached: dict[int, list[int]] = {}  # the tokens in each handle, in order
        self._generators: dict[int, torch.Generator] = {}

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Proposal]:
        """Up to ``ks[i]`` draft tokens for each ``seqs[i]``; none for a sequence whose
        tokens the draft's KV cache cannot hold now (after dropping the caches of
        sequences not in this call)."""
        spans: dict[int, tuple[SeqKV, list[int]]] = {}  # index in seqs -> what its next forward appends
        reserved = 0
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k <= 0:
                continue
            handle, new = self._sync(seq)
            need = self.kv.blocks_needed(handle, len(new) + k - 1)
            if not self.kv.can_append(handle, len(new) + k - 1, reserved):
                self._drop_others({s.seq_id for s in seqs})
                if not self.kv.can_append(handle, len(new) + k - 1, reserved):
                    continue
            reserved += need
            spans[i] = (handle, new)
        drafts: dict[int, list[int]] = {i: [] for i in spans}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in spans}
        while spans:
            order = list(spans)
            for i in order:
                self._cached[seqs[i].seq_id] += spans[i][1]
            logits = self.runner.logits([spans[i] for i in order])  # [S, W]
            rows = [self.runner.sampling_row(seqs[i], tuple(drafts[i]), self._generator(seqs[i])) for i in order]
            out = self.runner.sampler(logits, rows, return_probs=True)
            assert out.probs is not None
            for row, (i, token) in enumerate(zip(order, out.token_ids.tolist(), strict=True)):
                drafts[i].append(token)
                if seqs[i].request.temperature >= GREEDY_BELOW and seqs[i].constraint is None:
                    qs[i].append(out.probs[row])
                if len(drafts[i]) < ks[i]:
                    spans[i] = (spans[i][0], [token])
                else:
                    del spans[i]  # its last token is fed at the next call, if the target keeps it
        return [Proposal(drafts[i], torch.stack(qs[i]) if qs.get(i) else None) if i in drafts else Proposal([])
                for i in range(len(seqs))]

    def release(self, seq: Sequence) -> None:
        """Free the draft's KV blocks and state of ``seq``."""
        handle = self._handles.pop(seq.seq_id, None)
        if handle is not None:
            self.kv.free(handle)
        self._cached.pop(seq.seq_id, None)
        self._generators.pop(seq.seq_id, None)

    def _sync(self, seq: Sequence) -> tuple[SeqKV, list[int]]:
        """Roll the draft's cache of ``seq`` back to its common prefix with ``seq.all_ids``
        (keeping the last token uncached: its logits propose the first token); return the
        handle and the tokens still to append."""
        handle = self._handles.setdefault(seq.seq_id, SeqKV())
        cached = self._cached.setdefault(seq.seq_id, [])
        ids = seq.all_ids
        keep = min(common_prefix(cached, ids), len(ids) - 1)
        if keep < handle.num_tokens:
            if handle.num_evicted and keep < handle.num_tokens - self.kv.eviction_lag:
                keep = 0  # the window already freed blocks the rollback needs: start over
            self.kv.truncate(handle, keep)
            del cached[keep:]
        return handle, ids[keep:]

    def _drop_others(self, live: set[int]) -> None:
        """Free the draft caches of sequences not in ``live`` (preempted or waiting ones)."""
        for seq_id in [s for s in self._handles if s not in live]:
            self.kv.free(self._handles[seq_id])
            self._cached[seq_id].clear()

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(seq.generator.initial_seed() ^ DRAFT_SEED_SALT)
            self._generators[seq.seq_id] = gen
        return gen
