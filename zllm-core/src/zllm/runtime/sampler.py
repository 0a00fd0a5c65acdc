"""The runtime's one token sampler, batched over rows, with the semantics of ``zllm.domain.sampling``.

Dimension legend: ``S`` sequences (rows), ``R`` rows that draw at random, ``V`` columns of
the logits (the model's output width, padded vocabularies included), ``N`` top logprobs
per row, ``W = ceil(V / 32)`` words of a packed token bitmask.

Steps, in the reference's order: the row's logits mask (a grammar's allowed tokens), the
repetition penalty (prompt + output tokens), presence and frequency penalties (output
tokens), greedy argmax for ``temperature == 0``, then for the other rows temperature,
top-k, softmax, top-p, min-p and the exponential race ``argmax(probs / -log(u))`` with
``u = torch.rand(V, generator=row.generator)``.

Every step runs once over the whole batch. A row whose setting is off gets the neutral
value of that step (penalty 1, subtract 0, a threshold that drops nothing), which leaves
its values bit-identical, so a greedy row is exactly ``argmax`` of its penalised logits and
a seeded row draws the reference's token (the test suite checks both bit for bit). Each
row's uniforms are drawn by the reference's own call on its own generator. Per-row
settings reach the device as small ``[S, 1]`` columns; the only device-to-host read is the
caller's.

Logprobs are reported from the **raw model distribution**: ``log_softmax`` in f32 of the
logits the model produced, before the mask, penalties, temperature and filters (vLLM's
default, ``logprobs_mode="raw_logprobs"``), so a token's logprob does not depend on the
request's sampling settings. Speculative verification needs the distribution the token was
drawn from instead: ``return_probs=True`` returns it (after every step, renormalised; a
greedy row is one-hot at its token).

In batch-invariant mode (``Sampler(batch_invariant=True)``) each row runs through the same
ops on its own, as a batch of one, so a row's result does not depend on which other rows
share the step (a fixed reduction order whatever the batch).
"""

from __future__ import annotations

import attrs
import torch

from zllm.capabilities.ops import SamplingRow

LOGPROB_FLOOR = -9999.0
"""The lowest logprob reported: a token the model gives probability 0 (``-inf``) is reported
at this floor, which JSON can carry (vLLM uses the same value)."""

MAX_TOP_LOGPROBS = 20
"""The most top logprobs per token a request may ask for (OpenAI's limit)."""


@attrs.frozen(eq=False)
class SamplerOutput:
    """What one sampler call produced, one row per sequence, on the logits' device.

    Attributes:
        token_ids: int64 ``[S]``, the sampled tokens.
        logprobs: f32 ``[S]``, raw-distribution logprob of each sampled token (module doc),
            or None when not asked for.
        top_ids, top_logprobs: int64 / f32 ``[S, N]``, the ``N`` most likely tokens of the
            raw distribution, most likely first (ties: lowest id first), or None when
            ``N == 0``.
        probs: f32 ``[S, V]``, the distribution each token was drawn from, or None unless
            ``return_probs``.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    probs: torch.Tensor | None = None


@attrs.frozen
class TokenLogprob:
    """The raw-distribution logprob of one sampled token and the most likely alternatives
    (module doc), floored at :data:`LOGPROB_FLOOR`.

    Attributes:
        token_id: the sampled token.
        logprob: its logprob (natural log).
        top: ``(token id, logprob)`` of the request's ``logprobs`` most likely tokens, most
            likely first; empty when it asked for 0.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens ``1..P-1`` from the logits at the positions before them (the
    first token has no prediction): f32 ``[P, V]`` logits, ``P`` ids -> ``P - 1`` entries with
    the ``top_n`` most likely tokens at each position (raw distribution, floored as sampled
    tokens' are; vLLM's ``prompt_logprobs``).

    Raises:
        ValueError: ``top_n`` outside ``[0, MAX_TOP_LOGPROBS]``.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(prompt_ids), (logits.shape, len(prompt_ids))
    return token_logprobs(logits[:-1], prompt_ids[1:], top_n)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Raw-distribution logprobs of ``token_ids[i]`` under row ``i`` of f32 ``[N, V]`` logits,
    with the ``top_n`` most likely tokens of each row (ties: lowest id first), floored at
    :data:`LOGPROB_FLOOR`.

    Raises:
        ValueError: ``top_n`` outside ``[0, MAX_TOP_LOGPROBS]``.
    """
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].clamp_min(LOGPROB_FLOOR).tolist()
    ordered, order = logp.sort(dim=-1, descending=True, stable=True)
    top_values = ordered[:, :top_n].clamp_min(LOGPROB_FLOOR).tolist()
    top_ids = order[:, :top_n].tolist()
    return [TokenLogprob(t, c, tuple(zip(i, v, strict=True)))
            for t, c, i, v in zip(token_ids, chosen, top_ids, top_values, strict=True)]


def _column(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """Per-row settings as an f32 ``[rows, 1]`` column on ``like``'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]


def _token_matrix(ids: list[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row index, token id)`` int64 pairs, flattened, for the token ids ``ids[s]`` of every row ``s``."""
    sizes = [t.numel() for t in ids]
    # output_size: no device-to-host read of the sizes
    row_of = torch.repeat_interleave(torch.arange(len(ids), device=like.device),
                                     torch.tensor(sizes, device=like.device), output_size=sum(sizes))
    return row_of, torch.cat(ids)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed token bitmasks -> bool ``[..., V]``: int32 ``[..., W]``, bit ``j`` of word ``i``
    allows token ``32 * i + j`` (xgrammar's and llguidance's layout).

    Raises:
        ValueError: ``words`` is not int32 with a last dimension of ``ceil(V / 32)``.
    """
    if words.dtype != torch.int32 or words.dim() == 0 or words.shape[-1] != (vocab + 31) // 32:
        raise ValueError(f"a packed logits mask must be int32 [{(vocab + 31) // 32}] for {vocab} logits, "
                         f"got {words.dtype} {list(words.shape)}")
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> bits) & 1).bool().flatten(-2)[..., :vocab]  # [..., W * 32] -> [..., V]


def allows(mask: torch.Tensor, token_id: int) -> bool:
    """Whether a logits mask (bool ``[V]`` or packed int32 ``[W]``, :func:`apply_masks`)
    allows ``token_id``."""
    if mask.dtype == torch.bool:
        return bool(mask[token_id])
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Disallowed tokens become ``-inf``: f32 ``[S, V]`` -> a new f32 ``[S, V]``.

    ``masks[s]`` is None (row ``s`` unconstrained), bool ``[V]`` (True = allowed) or a packed
    int32 ``[W]`` bitmask (:func:`unpack_bitmask`), sized to the logits' width ``V`` — a
    padded vocabulary's extra columns included — on the logits' device. The packed masks of
    a step are unpacked together, in one set of tensor ops.

    Raises:
        ValueError: a mask of the wrong dtype or size (names the row), or one that allows no
            token (a grammar with no way on; sampling it would be undefined).
    """
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    allowed = torch.ones_like(logits, dtype=torch.bool)  # [S, V]
    packed_rows, packed = [], []
    for s, mask in enumerate(masks):
        if mask is None:
            continue
        if mask.dtype == torch.int32 and mask.shape == (words,):
            packed_rows.append(s)
            packed.append(mask)
        elif mask.dtype == torch.bool and mask.shape == (vocab,):
            allowed[s] = mask
        else:
            raise ValueError(f"row {s}: a logits mask must be bool [{vocab}] (the logits' width) or a packed int32 "
                             f"bitmask [{words}], got {mask.dtype} {list(mask.shape)}")
    if packed:
        allowed[torch.tensor(packed_rows, device=logits.device)] = unpack_bitmask(torch.stack(packed), vocab)
    if not bool(allowed.any(dim=-1).all()):
        empty = [s for s in range(len(masks)) if not bool(allowed[s].any())]
        raise ValueError(f"row {empty[0]}: the logits mask allows no token")
    return logits.masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties: f32 ``[S, V]`` -> a new f32 ``[S, V]``.

    Repetition (CTRL, Keskar et al. 2019): ``l / r`` where ``l > 0`` else ``l * r``, over
    tokens seen in prompt or output. Presence/frequency (OpenAI): ``l -= frequency * count +
    presence * (count > 0)`` over output tokens.
    """
    empty = logits.new_empty(0, dtype=torch.int64)
    if any(r.repetition_penalty != 1.0 for r in rows):
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [S, V]
        ids = [torch.cat([r.prompt_token_ids, r.output_token_ids]) if r.repetition_penalty != 1.0 else empty
               for r in rows]
        seen[_token_matrix(ids, logits)] = True
        penalty = _column([r.repetition_penalty for r in rows], logits)  # [S, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    counted = [r.output_token_ids.numel() > 0 and (r.presence_penalty != 0.0 or r.frequency_penalty != 0.0)
               for r in rows]
    if any(counted):
        counts = torch.zeros_like(logits)  # [S, V]
        pairs = _token_matrix([r.output_token_ids if c else empty for r, c in zip(rows, counted, strict=True)], logits)
        counts.index_put_(pairs, torch.ones(1, device=logits.device), accumulate=True)
        frequency = _column([r.frequency_penalty if c else 0.0 for r, c in zip(rows, counted, strict=True)], logits)
        presence = _column([r.presence_penalty if c else 0.0 for r, c in zip(rows, counted, strict=True)], logits)
        logits = logits - (frequency * counts + presence * (counts > 0).float())
    return logits


def _top_k(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logits below each row's k-th largest become ``-inf`` (ties kept); ``k`` outside ``(0, V)`` keeps all."""
    vocab = x.shape[1]
    ks = [r.top_k if 0 < r.top_k < vocab else 0 for r in rows]
    if not any(ks):
        return x
    largest = x.topk(max(ks), dim=-1).values  # [R, max k], descending
    index = torch.tensor([max(k, 1) - 1 for k in ks], device=x.device)[:, None]  # [R, 1]
    kth = largest.gather(1, index).masked_fill(_column(ks, x) == 0, float("-inf"))  # [R, 1]
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2019): keep a token while the mass strictly before it is ``< top_p``."""
    if all(r.top_p >= 1.0 for r in rows):
        return probs
    desc, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, V]
    before = desc.cumsum(dim=-1) - desc  # exclusive prefix mass
    limit = _column([r.top_p if r.top_p < 1.0 else float("inf") for r in rows], probs)  # inf: a row that keeps all
    drop = torch.empty_like(before, dtype=torch.bool).scatter_(1, order, before >= limit)  # back to vocab order
    return probs.masked_fill(drop, 0.0)


def _filtered(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """The steps between the penalties and the draw: int64 ``[S]`` argmax tokens (the greedy
    rows' answer), the indices of the rows that draw, and their f32 ``[R, V]`` probabilities
    after temperature, top-k, top-p and min-p (not renormalised; None when no row draws)."""
    tokens = logits.argmax(dim=-1)  # [S]
    drawn = [s for s, r in enumerate(rows) if r.temperature != 0.0]
    if not drawn:
        return tokens, drawn, None
    picked = [rows[s] for s in drawn]
    index = torch.tensor(drawn, device=logits.device)  # [R]
    x = _top_k(logits[index] / _column([r.temperature for r in picked], logits), picked)  # [R, V]
    probs = _top_p(torch.softmax(x, dim=-1), picked)
    if any(r.min_p > 0.0 for r in picked):  # Nguyen et al. 2024
        floor = _column([r.min_p for r in picked], probs) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
    return tokens, drawn, probs


def race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from f32 ``[V]`` probabilities (any positive scale): the exponential race
    ``argmax(probs / -log(u))``, ``u = torch.rand(V, generator=generator)`` (None: torch's
    global generator) — the draw every sampled token of the runtime makes, one generator
    call per token."""
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float32)
    return int((probs / -torch.log(u)).argmax())


def _draw(logits: torch.Tensor, rows: list[SamplingRow],
          return_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps after the penalties: int64 ``[S]`` tokens and, if asked, f32 ``[S, V]`` drawn-from probabilities."""
    tokens, drawn, probs = _filtered(logits, rows)
    probs_out = _distribution(logits, tokens, drawn, probs) if return_probs else None
    if probs is None:
        return tokens, probs_out
    index = torch.tensor(drawn, device=logits.device)  # [R]
    won = [race(p, rows[s].generator) for p, s in zip(probs, drawn, strict=True)]
    return tokens.index_put_((index,), torch.tensor(won, device=logits.device)), probs_out


def _distribution(logits: torch.Tensor, tokens: torch.Tensor, drawn: list[int],
                  probs: torch.Tensor | None) -> torch.Tensor:
    """f32 ``[S, V]``: each drawn row's filtered probabilities renormalised, every other
    (greedy) row one-hot at its argmax token (:func:`_filtered`'s outputs)."""
    out = torch.zeros_like(logits).scatter_(1, tokens[:, None], 1.0)
    if probs is not None:
        out[torch.tensor(drawn, device=logits.device)] = probs / probs.sum(dim=-1, keepdim=True)
    return out


def _masked_penalised(logits: torch.Tensor, rows: list[SamplingRow],
                      masks: list[torch.Tensor | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw, x)``: the logits in f32 and, from them, the masked and penalised logits that
    the filters and the draw start from."""
    raw = logits.float()  # [S, V]
    x = raw if masks is None or all(m is None for m in masks) else apply_masks(raw, masks)
    return raw, apply_penalties(x, rows)


class Sampler:
    """Samples one token per row of a step's logits and reports what logprobs and
    speculative verification need (the module doc gives the steps and the distributions).

    Args:
        batch_invariant: run each row on its own so results do not depend on the batch
            (config ``runtime.batch_invariant``).
    """

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], *,
                 masks: list[torch.Tensor | None] | None = None, logprobs: bool = False, top_logprobs: int = 0,
                 return_probs: bool = False) -> SamplerOutput:
        """Sample ``logits`` (any float dtype ``[S, V]``, computed in f32) under ``rows``
        (``S`` settings, generators on the logits' device).

        Args:
            masks: ``S`` entries for :func:`apply_masks`, or None for no mask at all.
            logprobs: report each sampled token's raw logprob.
            top_logprobs: ``N`` in ``[0, MAX_TOP_LOGPROBS]``: also report the ``N`` most
                likely tokens of the raw distribution and their logprobs.
            return_probs: also return the distribution each token was drawn from.

        Raises:
            ValueError: a bad mask (:func:`apply_masks`), ``len(masks) != S`` or
                ``top_logprobs`` out of range.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if masks is not None and len(masks) != len(rows):
            raise ValueError(f"{len(masks)} logits masks for {len(rows)} rows")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        if not self.batch_invariant or len(rows) <= 1:
            return self._batch(logits, rows, masks, logprobs, top_logprobs, return_probs)
        parts = [self._batch(logits[s: s + 1], rows[s: s + 1], None if masks is None else masks[s: s + 1],
                             logprobs, top_logprobs, return_probs) for s in range(len(rows))]

        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return SamplerOutput(torch.cat([p.token_ids for p in parts]), cat("logprobs"), cat("top_ids"),
                             cat("top_logprobs"), cat("probs"))

    def distributions(self, logits: torch.Tensor, rows: list[SamplingRow], *,
                      masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """The distribution each row's token would be drawn from, without drawing: f32
        ``[S, V]``, every step of the module doc applied and renormalised; a greedy row is
        one-hot at its argmax. Speculative verification compares proposals against it.
        Batch-invariant mode computes each row on its own."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if self.batch_invariant and len(rows) > 1:
            return torch.cat([self.distributions(logits[s: s + 1], rows[s: s + 1],
                                                 masks=None if masks is None else masks[s: s + 1])
                              for s in range(len(rows))])
        _, x = _masked_penalised(logits, rows, masks)
        return _distribution(x, *_filtered(x, rows))

    @staticmethod
    def _batch(logits: torch.Tensor, rows: list[SamplingRow], masks: list[torch.Tensor | None] | None,
               want_logprobs: bool, top_logprobs: int, return_probs: bool) -> SamplerOutput:
        if not rows:
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return SamplerOutput(empty)
        raw, x = _masked_penalised(logits, rows, masks)
        tokens, probs = _draw(x, rows, return_probs)
        out_logprobs = top_ids = top_values = None
        if want_logprobs or top_logprobs:
            logp = torch.log_softmax(raw, dim=-1)  # [S, V], the raw model distribution
            out_logprobs = logp.gather(1, tokens[:, None])[:, 0].clamp_min(LOGPROB_FLOOR)  # [S]
            if top_logprobs:
                # A stable descending sort puts equal logprobs lowest id first, which topk does not promise.
                top_values, top_ids = logp.sort(dim=-1, descending=True, stable=True)
                top_values, top_ids = top_values[:, :top_logprobs].clamp_min(LOGPROB_FLOOR), top_ids[:, :top_logprobs]
        return SamplerOutput(tokens, out_logprobs, top_ids, top_values, probs)
