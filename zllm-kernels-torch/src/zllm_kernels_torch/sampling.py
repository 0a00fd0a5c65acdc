"""Device-generic token sampling, batched over rows, with the semantics of ``zllm.domain.sampling``.

Dimension legend: ``S`` sequences (rows), ``R`` rows that draw at random, ``V`` vocabulary.

Steps, in the reference's order: repetition penalty (prompt + output tokens), presence and
frequency penalties (output tokens), greedy argmax for ``temperature == 0``, then for the
other rows temperature, top-k, softmax, top-p, min-p and the exponential race
``argmax(probs / -log(u))`` with ``u = torch.rand(V, generator=row.generator)``.

Every step runs once over the whole batch. A row whose setting is off gets the neutral
value of that step (penalty 1, subtract 0, a threshold that drops nothing), which leaves
its values bit-identical, so a greedy row is exactly ``argmax`` of its penalised logits.
Each row's uniforms are drawn by the reference's own call on its own generator, so a
seeded request gives the reference's tokens on the same device. Per-row settings reach
the device as small ``[S, 1]`` columns; the only device-to-host read is the caller's.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import SamplingRow


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


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties: f32 ``[S, V]`` -> a new f32 ``[S, V]``.

    Repetition (CTRL, Keskar et al. 2019): ``l / r`` where ``l > 0`` else ``l * r``, over
    tokens seen in prompt or output. Presence/frequency (OpenAI): ``l -= frequency * count +
    presence * (count > 0)`` over output tokens.
    """
    empty = logits.new_empty(0, dtype=torch.int64)
    if any(r.repetition_penalty != 1.0 for r in rows):
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [S, V]
        ids = [
            torch.cat([r.prompt_token_ids, r.output_token_ids]) if r.repetition_penalty != 1.0 else empty for r in rows
        ]
        seen[_token_matrix(ids, logits)] = True
        penalty = _column([r.repetition_penalty for r in rows], logits)  # [S, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    counted = [
        r.output_token_ids.numel() > 0 and (r.presence_penalty != 0.0 or r.frequency_penalty != 0.0) for r in rows
    ]
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


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row: ``logits`` f32 ``[S, V]``, ``rows`` ``S`` settings -> int64 ``[S]`` on ``logits``' device."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = apply_penalties(logits.float(), rows)  # [S, V]
    tokens = logits.argmax(dim=-1)  # [S]: the greedy rows' answer
    drawn = [s for s, r in enumerate(rows) if r.temperature != 0.0]
    if not drawn:
        return tokens
    picked = [rows[s] for s in drawn]
    index = torch.tensor(drawn, device=logits.device)  # [R]
    x = _top_k(logits[index] / _column([r.temperature for r in picked], logits), picked)  # [R, V]
    probs = _top_p(torch.softmax(x, dim=-1), picked)
    if any(r.min_p > 0.0 for r in picked):  # Nguyen et al. 2024
        probs = probs.masked_fill(
            probs < _column([r.min_p for r in picked], probs) * probs.amax(dim=-1, keepdim=True), 0.0
        )
    vocab = logits.shape[1]
    race = torch.stack([-torch.log(torch.rand(vocab, generator=r.generator, device=logits.device, dtype=torch.float32))
                        for r in picked])  # [R, V]
    return tokens.index_put_((index,), (probs / race).argmax(dim=-1))
