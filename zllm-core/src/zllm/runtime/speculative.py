"""Speculative decoding: proposals, their verification, and how many to make.

A proposer guesses the next ``k`` tokens of a decoding sequence; one step of the target
model computes the sequence's next token and the ``k`` proposals together (``k + 1``
verify rows), and :func:`verify` keeps the longest prefix the target agrees with plus one
token of its own. The cache state is a transaction: the step appends ``k + 1`` tokens'
KV, and the runner rolls the rejected ones back (:meth:`PagedKVCache.truncate`) before the
next step, so the cache holds exactly what a run without speculation would hold.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023): with ``p`` the target's distribution at a row
(after penalties, temperature, top-k/p, min-p — :meth:`Sampler.distributions`) and ``q``
the proposer's, a proposal ``x`` is kept with probability ``min(1, p(x) / q(x))``; the first
rejection draws from ``norm(max(0, p - q))``; a fully accepted run draws a bonus token from
the next ``p``. The output is distributed exactly as the target's. A proposer without a
distribution (n-gram) has ``q`` one-hot at its proposal. A greedy row's ``p`` is one-hot at
the target's argmax, so greedy verification keeps the prefix equal to the target's argmax
and takes the target's token at the first mismatch — token-identical to greedy decoding
without speculation whenever the verify rows' logits equal the one-row steps' (the
batch-invariant mode makes them bit-identical).

:class:`Lookahead` adapts ``k`` per sequence from its measured acceptance, down to no
speculation with an occasional probe, so a proposer that keeps failing costs little.

Proposers: :class:`NgramProposer` (``speculative.method: ngram``), and
:class:`zllm.runtime.mtp.MtpProposer` (``mtp``): the checkpoint's own multi-token-prediction
layer (DeepSeek-V3's nextn layer), a :class:`HiddenStateProposer` that reads the target's
hidden states after every step and keeps its own paged cache in step with the target's.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol, runtime_checkable

import attrs
import torch

from zllm.runtime.sampler import race
from zllm.runtime.sequence import Sequence


@attrs.frozen(eq=False)
class Proposal:
    """A proposer's guess for one sequence.

    Attributes:
        tokens: the proposed next tokens (possibly none).
        q: f32 ``[len(tokens), V]``, the distribution each token was drawn from (a draft
            model's, after the request's sampling settings), or None: each token is certain
            (one-hot), as for n-gram lookup.
    """

    tokens: list[int]
    q: torch.Tensor | None = None

    def cut(self, n: int) -> Proposal:
        """The first ``n`` tokens of the proposal."""
        return Proposal(self.tokens[:n], None if self.q is None else self.q[:n])


class Proposer(Protocol):
    """Guesses the next tokens of decoding sequences. Runs on the engine loop's thread."""

    name: str

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Proposal]:
        """Up to ``ks[i]`` next tokens of ``seqs[i]`` after ``seqs[i].all_ids`` (fewer, or
        none, when it has no guess; ``ks[i] == 0`` asks for none)."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (finished, aborted or expired): drop what the proposer keeps for it."""
        ...


@attrs.frozen(eq=False)
class HiddenRows:
    """The target model's hidden states of one sequence's tokens that a step computed and
    kept (a verify step's rejected rows are not among them).

    Attributes:
        seq: the sequence.
        start: the position of the first row's token.
        hidden: ``[r, C]`` the hidden state each of positions ``start .. start + r - 1``
            produced: the vector the model's output head maps to the logits of the token
            after it (``Model.forward(..., return_hidden=True)``), in the model's dtype.
    """

    seq: Sequence
    start: int
    hidden: torch.Tensor


@runtime_checkable
class HiddenStateProposer(Proposer, Protocol):
    """A proposer that reads the target's hidden states (multi-token prediction): the engine
    runs the model with ``return_hidden=True`` and hands it every step's kept rows."""

    def observe(self, rows: Seq[HiddenRows]) -> None:
        """After a step's tokens are accepted: the kept rows of every sequence the step
        computed (prefill chunks included). A sequence that finished in the step was already
        released; its rows are among them and are to be ignored."""
        ...


class NgramProposer:
    """Prompt lookup (Saxena 2023; vLLM's ``ngram``, llama.cpp's ``lookup``): find the most
    recent earlier occurrence of the sequence's last ``n`` tokens in its own prompt and
    output, longest ``n`` from ``max_n`` down to ``min_n`` first, and propose the tokens
    that followed it.

    Args:
        min_n, max_n: the n-gram sizes tried, ``1 <= min_n <= max_n``.
    """

    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Proposal]:
        return [Proposal(self._one(s.all_ids, k) if k > 0 else []) for s, k in zip(seqs, ks, strict=True)]

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""

    def _one(self, ids: list[int], k: int) -> list[int]:
        length = len(ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = ids[length - n:]
            # Most recent earlier match first: the nearest context predicts best.
            for start in range(length - n - 1, -1, -1):
                if ids[start: start + n] == tail:
                    return ids[start + n: start + n + k]
        return []


def verify(p: torch.Tensor, drafts: Seq[int], generator: torch.Generator, greedy: bool,
           q: torch.Tensor | None = None) -> list[int]:
    """The tokens a verify step produces for one sequence: the accepted proposals, then one
    token of the target's (the correction at the first rejection, or the bonus after a full
    accept). See the module doc for the rule.

    Args:
        p: f32 ``[k + 1, V]`` target distributions of the verify rows (row ``i`` follows the
            first ``i`` proposals), each summing to 1.
        drafts: the ``k`` proposals.
        generator: the sequence's generator (every uniform and every draw come from it, so a
            seeded request is reproducible).
        greedy: the rows are one-hot (temperature 0): no draw is made.
        q: f32 ``[k, V]`` proposal distributions, or None for one-hot proposals.

    Returns:
        ``a + 1`` token ids, ``a`` the number of proposals accepted.
    """
    k = len(drafts)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k), (p.shape, k)
    for i, x in enumerate(drafts):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if greedy:
            if px == 1.0:
                continue
            return [*drafts[:i], int(p[i].argmax())]
        u = float(torch.rand(1, generator=generator, device=p.device, dtype=torch.float32))
        if qx > 0.0 and u < min(1.0, px / qx):
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q everywhere (rounding): rejection is impossible in exact terms
            residual = p[i]
        return [*drafts[:i], race(residual, generator)]
    last = p[k]
    return [*drafts, int(last.argmax()) if greedy else race(last, generator)]


@attrs.define
class Lookahead:
    """How many tokens to propose next for one sequence.

    An exponential moving average of the acceptance rate (weight ``1/4`` per step) scales
    ``max_k``; below ``1 / (2 max_k)`` the sequence stops speculating and probes with one
    proposal every ``probe_every`` steps, so a proposer that never hits costs a probe now
    and then. ``adaptive`` off always proposes ``max_k``.
    """

    max_k: int
    adaptive: bool = True
    rate: float = 1.0
    idle_steps: int = 0
    probe_every: int = 8

    def next_k(self) -> int:
        if not self.adaptive:
            return self.max_k
        k = round(self.rate * self.max_k)
        if k >= 1:
            return k
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every:
            self.idle_steps = 0
            return 1
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        """Record one verify step: ``accepted`` of ``proposed`` proposals kept."""
        if proposed:
            self.rate += (accepted / proposed - self.rate) / 4


@attrs.define
class SpecStats:
    """Counters over every verify step of an engine.

    Attributes:
        steps: sequence-steps that verified at least one proposal.
        proposed, accepted: per draft position ``j`` (0-based), proposals made at that
            position and those accepted; ``accepted[j] / proposed[j]`` is its acceptance rate.
    """

    steps: int = 0
    proposed: list[int] = attrs.field(factory=list)
    accepted: list[int] = attrs.field(factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        while len(self.proposed) < proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for j in range(proposed):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed over every position, or None before any proposal."""
        total = sum(self.proposed)
        return sum(self.accepted) / total if total else None
