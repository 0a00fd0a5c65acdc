"""f32 reference of token sampling, one row (sequence) at a time: the oracle of the runtime's sampler.

Sampling is not a backend op: :mod:`zllm.runtime.sampler` samples every backend's logits,
batched, and is tested against this row-at-a-time reference bit for bit. The reference
leaves out what the runtime adds around the same math — the logits mask (applied first,
disallowed tokens ``-inf``) and the reported logprobs.

Dimension legend: ``S`` sequences (rows), ``V`` vocabulary.

Per row, in this order (vLLM / HF ``generate`` logits processors):

1. repetition penalty (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``):
   for every token in prompt or output, ``l / r`` if ``l > 0`` else ``l * r``.
2. presence / frequency penalties (OpenAI API semantics), output tokens only:
   ``l -= frequency * count + presence * (count > 0)``.
3. ``temperature == 0``: greedy, ``argmax`` of the penalised logits (lowest index on ties,
   ``torch.argmax``); the generator is not touched. Otherwise ``l = l / temperature``.
4. top-k (0, -1 or >= V disables): logits below the k-th largest become ``-inf`` (ties at the
   k-th value are kept, as in vLLM).
5. ``probs = softmax(l)``.
6. top-p (nucleus, Holtzman et al. 2019; ``top_p >= 1`` disables): sort descending (stable),
   keep token ``i`` when the mass strictly before it is ``< top_p`` -> the smallest prefix
   whose mass reaches ``top_p``; the most likely token is always kept.
7. min-p (Nguyen et al. 2024; 0 disables): drop tokens with ``p < min_p * max(p)``.
8. the draw — an exponential race, equivalent to the Gumbel-max trick:
   ``u = torch.rand(V, generator=g, device=logits.device)`` (f32),
   ``token = argmax(probs / -log(u))``. Probabilities are not renormalised after steps 6-7:
   the race only needs them up to a common factor. Dropped tokens have ``p == 0`` and
   never win. Kernels reproduce a row bit for bit by drawing ``u`` with the same call
   and applying the same f32 element-wise ops.
"""

from __future__ import annotations

import torch

from zllm.capabilities.ops import SamplingRow


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw a token from (unnormalised) f32 ``probs [V]``: ``argmax(probs / -log(u))``, ``u ~ U[0,1)^V``."""
    assert probs.dim() == 1 and probs.dtype == torch.float32, (probs.shape, probs.dtype)
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float32)  # [V]
    return int(torch.argmax(probs / -torch.log(u)))


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """One token id for f32 ``logits [V]`` under ``row``'s settings (steps 1-8 of the module doc)."""
    assert logits.dim() == 1, logits.shape
    assert row.temperature >= 0 and row.repetition_penalty > 0 and 0 < row.top_p <= 1 and 0 <= row.min_p <= 1, row
    vocab = logits.shape[0]
    logits = logits.float().clone()  # [V]

    if row.repetition_penalty != 1.0:
        seen = torch.cat([row.prompt_token_ids, row.output_token_ids]).unique()  # [U]
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / row.repetition_penalty, picked * row.repetition_penalty)

    if row.output_token_ids.numel() and (row.presence_penalty != 0.0 or row.frequency_penalty != 0.0):
        counts = torch.bincount(row.output_token_ids, minlength=vocab).float()  # [V]
        logits = logits - (row.frequency_penalty * counts + row.presence_penalty * (counts > 0).float())

    if row.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / row.temperature

    if 0 < row.top_k < vocab:
        kth = torch.topk(logits, row.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))

    probs = torch.softmax(logits, dim=-1)  # [V]

    if row.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True, stable=True)  # [V], [V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exclusive prefix sum
        drop_sorted = mass_before >= row.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)  # back to vocab order
        probs = probs.masked_fill(drop, 0.0)

    if row.min_p > 0.0:
        probs = probs.masked_fill(probs < row.min_p * probs.max(), 0.0)

    return exponential_race(probs, row.generator)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row: ``logits`` f32 ``[S, V]``, ``rows`` ``S`` settings -> int64 ``[S]``."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    return torch.tensor(
        [sample_row(logits[s], rows[s]) for s in range(len(rows))], dtype=torch.int64, device=logits.device
    )

