"""Runs one scheduled step: builds the flattened batch, calls the model, samples.

Dimension legend: T new tokens in the step (all sequences), S sequences in the step,
S' sequences that reach their end in this step and therefore sample a token, MB the
longest block table among them.

Per-step host work is kept small because it is paid on every decode round: the step's
integer inputs (token ids, positions, slots, logits rows and the block table) travel to
the device as one int64 tensor whose slices are the model's inputs (one allocation and one
copy instead of five), and a step whose sampling rows are all greedy without penalties,
mask or logprobs takes ``argmax`` of the logits directly — what the sampling contract
defines greedy as (``zllm.domain.sampling``, step 3; vLLM's all-greedy fast path) —
skipping the sampler's copy of the logits and the per-row settings.

Tokens are sampled by the runtime's one sampler (:mod:`zllm.runtime.sampler`), never by a
backend kernel, so a seeded request draws the same tokens on every backend that computes
the same logits.
"""

from __future__ import annotations

import math

import attrs
import torch

from zllm.capabilities.ops import AttentionMetadata, SamplingRow
from zllm.runtime.kv_cache import PagedKVCache, SeqKV
from zllm.runtime.sampler import Sampler, TokenLogprob, token_logprobs
from zllm.runtime.scheduler import ScheduledStep
from zllm.runtime.sequence import Sequence
from zllm.runtime.speculative import HiddenRows, Proposal, verify

_EMPTY = torch.empty(0, dtype=torch.int64)

# Sampling kernels compute in f32. Request values that are valid but extreme would turn the
# logits into inf / NaN there (temperature 1e-300 and top_p 1e-300 round to 0; a repetition
# penalty of 1e-300 or 1e300 overflows), and every NaN row samples token 0. They are mapped
# to values that select the same tokens: a temperature below GREEDY_BELOW is greedy (as in
# vLLM), top_p is at least TOP_P_MIN (still only the most likely token), and the repetition
# penalty is kept within REPETITION_PENALTY_RANGE (still saturating).
GREEDY_BELOW = 1e-5
TOP_P_MIN = 1e-30
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _is_plain_greedy(seq: Sequence) -> bool:
    """Whether a sequence samples ``argmax(logits)`` and reports nothing else: greedy
    temperature, no penalty, no logits mask, no logprobs."""
    r = seq.request
    return (r.temperature < GREEDY_BELOW and r.repetition_penalty == 1.0 and r.presence_penalty == 0.0
            and r.frequency_penalty == 0.0 and r.logprobs is None and seq.constraint is None)


def _mask(seq: Sequence, device: torch.device) -> torch.Tensor | None:
    """The sequence's allowed tokens for this sample, on the logits' device (None: any)."""
    if seq.constraint is None:
        return None
    mask = seq.constraint.allowed_tokens()
    return None if mask is None else mask.to(device)


def check_finite_logits(logits: torch.Tensor) -> None:
    """Refuse a step whose logits hold a NaN or an infinity: sampling would read one as a token
    (argmax of a NaN row is its first NaN), and the output would be text made of token 0.

    Args:
        logits: f32 ``[S', V]``, the step's sampled and verified rows.

    Raises:
        RuntimeError: naming the rows and the likely causes. The engine loop ends every live
            request with it (``zllm run`` exits 3), as the MoE router's own check does: a
            non-finite weight in the checkpoint affects every request.
    """
    # One reduction for the common case; a sum can overflow for finite logits, which the
    # elementwise check then tells apart.
    if logits.numel() == 0 or math.isfinite(logits.sum()):
        return
    bad = (~torch.isfinite(logits)).any(dim=-1).nonzero().flatten().tolist()
    if bad:
        raise RuntimeError(f"the model's logits are not finite in {len(bad)} of {logits.shape[0]} rows (a NaN or "
                           "infinite weight in the checkpoint, or an overflow in the forward pass)")


@attrs.frozen
class Sampled:
    """One sequence's result of a step: its new tokens (one, or after a verify step the
    accepted proposals and the target's token), their logprobs when the request asked (one
    per token), and how many proposals the step verified."""

    seq: Sequence
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    proposed: int = 0


class ModelRunner:
    """Owns the model, its bound kernels and the KV cache of one engine.

    ``sample_width``: tokens are sampled from the first ``sample_width`` logits columns only
    (the tokenizer's vocabulary): a padded vocabulary's extra columns belong to no token, and
    a token the tokenizer cannot decode must never be drawn. None = every column.
    """

    def __init__(self, model, ops, kv: PagedKVCache, device: torch.device, batch_invariant: bool = False,
                 sample_width: int | None = None):
        self.model, self.ops, self.kv, self.device = model, ops, kv, device
        self.sample_width = sample_width
        self.scale = kv.spec.attention_scale  # the family's, not derived from a cached width
        self.sampler = Sampler(batch_invariant=batch_invariant)
        self.keep_hidden = False
        """Run the model with ``return_hidden=True`` and keep each step's :attr:`hidden_rows`
        (set when the proposer reads hidden states, :class:`HiddenStateProposer`)."""
        self.hidden_rows: list[HiddenRows] = []
        """The last step's kept hidden rows per sequence, when :attr:`keep_hidden`."""

    def execute(self, step: ScheduledStep) -> list[Sampled]:
        """Compute the step's tokens; return one :class:`Sampled` for every sequence whose
        computed span reached its last token. A decode item with lookahead tokens is a verify
        step (:mod:`zllm.runtime.speculative`): its rejected tokens' KV is rolled back before
        this returns.

        Raises:
            ValueError: a sequence's constraint returned a bad mask
                (:func:`zllm.runtime.sampler.apply_masks`).
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        sampling: list[Sequence] = []
        logits_rows: list[int] = []
        verifying: list[tuple[Sequence, Proposal, int]] = []  # (seq, proposal, KV length before it)
        verify_rows: list[int] = []
        spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, first position, new tokens)
        for i, (seq, n) in enumerate(step.items):
            proposal = step.lookahead[i] if step.lookahead else None
            draft = proposal.tokens if proposal is not None else []
            start = seq.num_computed
            spans.append((seq, len(ids), start, n))
            ids += seq.token_span(start, start + n) + draft
            m = n + len(draft)
            positions += range(start, start + m)
            slots += self.kv.append(seq.kv, m)
            query_lens.append(m)
            if proposal is not None:
                verifying.append((seq, proposal, start + n))
                verify_rows += range(len(ids) - len(draft) - 1, len(ids))
            elif seq.num_computed == seq.num_tokens:
                sampling.append(seq)
                logits_rows.append(len(ids) - 1)
        with torch.inference_mode():
            out = self._forward(ids, positions, slots, [s.kv for s, _ in step.items], tuple(query_lens),
                                logits_rows + verify_rows, return_hidden=self.keep_hidden)
            logits, hidden = out if self.keep_hidden else (out, None)  # [S' + sum(k + 1), V], [T, C]
            if self.sample_width is not None and logits.shape[1] > self.sample_width:
                logits = logits[:, : self.sample_width]  # a view: padded columns are never candidates
            check_finite_logits(logits)
            results = self._sample(logits[: len(sampling)], sampling) if sampling else []
            if verifying:
                results += self._verify(logits[len(sampling):], verifying)
        if hidden is not None:
            accepted = {r.seq.seq_id: len(r.token_ids) - 1 for r in results if r.proposed}
            self.hidden_rows = [HiddenRows(seq, start, hidden[row: row + n + accepted.get(seq.seq_id, 0)])
                                for seq, row, start, n in spans]
        return results

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence]) -> list[Sampled]:
        """One token per sequence from f32 ``[S', V]`` logits."""
        if all(_is_plain_greedy(s) for s in sampling):
            tokens = torch.argmax(logits, dim=-1)  # [S'], lowest index on ties, as the sampler
            return [Sampled(s, (t,)) for s, t in zip(sampling, tokens.tolist(), strict=True)]
        masks = [_mask(s, self.device) for s in sampling]
        wanted = [s.request.logprobs for s in sampling]
        top = max((n for n in wanted if n is not None), default=0)
        out = self.sampler(logits, [self.sampling_row(s) for s in sampling],
                           masks=masks if any(m is not None for m in masks) else None,
                           logprobs=any(n is not None for n in wanted), top_logprobs=top)
        return self._results(sampling, wanted, out)

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[Sequence, Proposal, int]]) -> list[Sampled]:
        """Verify each sequence's proposal against its ``k + 1`` rows of f32 logits, then roll
        its KV back to the tokens it keeps."""
        rows = [self.sampling_row(seq, tuple(p.tokens[:j]))
                for seq, p, _ in verifying for j in range(len(p.tokens) + 1)]
        masks = [m for seq, p, _ in verifying for m in self._verify_masks(seq, p.tokens)]
        dist = self.sampler.distributions(logits, rows, masks=masks if any(m is not None for m in masks) else None)
        results = []
        offset = 0
        for seq, proposal, kept in verifying:
            k = len(proposal.tokens)
            tokens = verify(dist[offset: offset + k + 1], proposal.tokens, seq.generator,
                            greedy=seq.request.temperature < GREEDY_BELOW, q=proposal.q)
            self.kv.truncate(seq.kv, kept + len(tokens) - 1)  # the last token is not computed yet
            logprobs = () if seq.request.logprobs is None else tuple(
                token_logprobs(logits[offset: offset + len(tokens)], tokens, seq.request.logprobs))
            results.append(Sampled(seq, tuple(tokens), logprobs, k))
            offset += k + 1
        return results

    def _verify_masks(self, seq: Sequence, proposal: list[int]) -> list[torch.Tensor | None]:
        """The grammar's mask for each of the ``k + 1`` verify rows of ``seq`` (row ``i``
        after the first ``i`` proposals), from a fork of its constraint; None without one."""
        if seq.constraint is None:
            return [None] * (len(proposal) + 1)
        walk = seq.constraint.fork()
        masks = []
        for token in [*proposal, None]:
            # A row after the token that completed the grammar is never used: the sequence ends there.
            mask = None if walk.finished else walk.allowed_tokens()
            masks.append(None if mask is None else mask.clone().to(self.device))
            if token is not None:
                walk.accept(token)
        return masks

    @staticmethod
    def _results(sampling: list[Sequence], wanted: list[int | None], out) -> list[Sampled]:
        """Host values of a sampler call: one read of each output tensor for the whole step."""
        tokens = out.token_ids.tolist()
        if out.logprobs is None:
            return [Sampled(s, (t,)) for s, t in zip(sampling, tokens, strict=True)]
        chosen = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in sampling]
        top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in sampling]
        results = []
        for i, (seq, n) in enumerate(zip(sampling, wanted, strict=True)):
            logprobs = () if n is None else (TokenLogprob(
                tokens[i], chosen[i], tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True))),)
            results.append(Sampled(seq, (tokens[i],), logprobs))
        return results

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """f32 ``[P, V]`` logits for every prompt position, through a throwaway KV handle."""
        seq_kv = SeqKV()
        n = len(prompt_ids)
        try:
            slots = self.kv.append(seq_kv, n)
            with torch.inference_mode():
                return self._forward(prompt_ids, list(range(n)), slots, [seq_kv], (n,), list(range(n)))
        finally:
            self.kv.free(seq_kv)

    def logits(self, spans: list[tuple[SeqKV, list[int]]]) -> torch.Tensor:
        """f32 ``[S, W]`` logits after the last token of each span, ``W`` the sampling width:
        each ``(handle, tokens)`` appends its tokens (at least one) to what ``handle`` caches,
        all spans in one forward (a draft model's proposal step).

        Raises:
            OutOfKVBlocks: the cache cannot hold a span (check ``kv.can_append`` first).
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for handle, tokens in spans:
            assert tokens, "a span appends at least one token"
            positions += range(handle.num_tokens, handle.num_tokens + len(tokens))
            slots += self.kv.append(handle, len(tokens))
            ids += tokens
            rows.append(len(ids) - 1)
        with torch.inference_mode():
            logits = self._forward(ids, positions, slots, [h for h, _ in spans],
                                   tuple(len(t) for _, t in spans), rows)  # [S, V]
        return logits if self.sample_width is None else logits[:, : self.sample_width]

    def _forward(self, ids: list[int], positions: list[int], slots: list[int], seqs: list[SeqKV],
                 query_lens: tuple[int, ...], logits_rows: list[int], return_hidden: bool = False):
        """One model forward over a flattened batch whose slots are already reserved: the
        logits, or with ``return_hidden`` the pair ``(logits, hidden [T, C])``."""
        t, r = len(ids), len(logits_rows)
        table, width = self.kv.block_table_rows(seqs)  # S * MB ids
        # One host list -> one int64 tensor: [ids T | positions T | slots T | logits rows S' | block table S*MB].
        packed = torch.tensor(ids + positions + slots + logits_rows + table, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=packed[2 * t: 3 * t],
            block_tables=packed[3 * t + r:].view(len(seqs), width),
            query_lens=query_lens,
            context_lens=tuple(s.num_tokens for s in seqs),
            scale=self.scale,
        )
        if return_hidden:
            return self.model.forward(packed[:t], packed[t: 2 * t], meta, self.kv.layers, packed[3 * t: 3 * t + r],
                                      return_hidden=True)
        return self.model.forward(packed[:t], packed[t: 2 * t], meta, self.kv.layers, packed[3 * t: 3 * t + r])

    def sampling_row(self, seq: Sequence, lookahead: tuple[int, ...] = (),
                     generator: torch.Generator | None = None) -> SamplingRow:
        """``seq``'s settings for its next token, or for the token after ``lookahead`` (a
        verify row, or a draft model's next proposal: its penalties count the tokens before it
        as output); draws come from ``generator``, default the sequence's own."""
        r = seq.request
        penalised = r.repetition_penalty != 1.0 or r.presence_penalty != 0.0 or r.frequency_penalty != 0.0
        return SamplingRow(
            temperature=0.0 if r.temperature < GREEDY_BELOW else r.temperature, top_k=r.top_k,
            top_p=max(r.top_p, TOP_P_MIN), min_p=r.min_p,
            repetition_penalty=min(max(r.repetition_penalty, REPETITION_PENALTY_RANGE[0]), REPETITION_PENALTY_RANGE[1]),
            presence_penalty=r.presence_penalty,
            frequency_penalty=r.frequency_penalty,
            prompt_token_ids=seq.prompt_tensor.to(self.device) if penalised else _EMPTY,
            output_token_ids=(
                torch.tensor(seq.output_ids + list(lookahead), dtype=torch.int64, device=self.device) if penalised
                else _EMPTY
            ),
            generator=seq.generator if generator is None else generator,
        )
