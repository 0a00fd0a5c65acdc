"""CPU kernel for token sampling, batched over rows; same tokens as the f32 reference.

Dimension legend: ``S`` sequences (rows), ``V`` vocabulary.

Implements exactly the steps of ``zllm.domain.sampling`` (repetition penalty, presence and
frequency penalties, temperature / greedy, top-k, softmax, top-p, min-p, exponential race
``argmax(probs / -log(u))`` with ``u = torch.rand(V, generator=row.generator)``). Each
step is written so that a disabled setting leaves the row bit-identical (divide by 1,
subtract 0, threshold that drops nothing), which lets the whole batch run through the same
f32 ops; the per-row random numbers and their ``log`` are computed row by row, exactly as
the reference does, so vectorisation differences cannot change a bit.
"""

from __future__ import annotations

import torch

from zllm.plugin_api import SamplingRow


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row: ``logits`` f32 ``[S, V]``, ``rows`` ``S`` settings -> int64 ``[S]``."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    dev = logits.device
    logits = logits.float().clone()  # [S, V]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # [S, 1]

    # 1. repetition penalty over prompt + output tokens
    penalised = [s for s, r in enumerate(rows) if r.repetition_penalty != 1.0]
    if penalised:
        seen = torch.zeros(n_rows, vocab, dtype=torch.bool, device=dev)  # [S, V]
        for s in penalised:
            seen[s, rows[s].prompt_token_ids] = True
            seen[s, rows[s].output_token_ids] = True
        pen = column([r.repetition_penalty for r in rows])
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)

    # 2. presence / frequency over output tokens
    counted = [
        s for s, r in enumerate(rows)
        if r.output_token_ids.numel() and (r.presence_penalty != 0.0 or r.frequency_penalty != 0.0)
    ]
    if counted:
        counts = torch.zeros(n_rows, vocab, dtype=torch.float32, device=dev)  # [S, V]
        for s in counted:
            counts[s] = torch.bincount(rows[s].output_token_ids, minlength=vocab).float()
        freq = column([r.frequency_penalty if s in counted else 0.0 for s, r in enumerate(rows)])
        pres = column([r.presence_penalty if s in counted else 0.0 for s, r in enumerate(rows)])
        sub = freq * counts + pres * (counts > 0).float()
        idx = torch.tensor(counted, device=dev)
        logits[idx] = logits[idx] - sub[idx]

    tokens = torch.argmax(logits, dim=-1)  # [S], the greedy answer
    random_rows = [s for s, r in enumerate(rows) if r.temperature != 0.0]
    if not random_rows:
        return tokens
    sel = torch.tensor(random_rows, device=dev)
    rs = [rows[s] for s in random_rows]
    x = logits[sel] / column([r.temperature for r in rs])  # [R, V]

    # 4. top-k (ties at the k-th value kept); k outside (0, V) disables
    ks = [r.top_k if 0 < r.top_k < vocab else vocab for r in rs]
    if any(k < vocab for k in ks):
        sorted_x = x.sort(dim=-1, descending=True).values  # [R, V]
        kth = sorted_x.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)  # [R, 1]
        x = x.masked_fill(x < kth, float("-inf"))

    probs = torch.softmax(x, dim=-1)  # [R, V]

    # 6. top-p
    ps = [r.top_p for r in rs]
    if any(p < 1.0 for p in ps):
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, V]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        active = torch.tensor([p < 1.0 for p in ps], device=dev)[:, None]  # [R, 1]
        drop_sorted = (mass_before >= column(ps)) & active
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)

    # 7. min-p
    mins = [r.min_p for r in rs]
    if any(m > 0.0 for m in mins):
        threshold = column(mins) * probs.amax(dim=-1, keepdim=True)  # [R, 1]; 0 for disabled rows
        probs = probs.masked_fill(probs < threshold, 0.0)

    # 8. exponential race, random numbers and their log per row as in the reference
    q = torch.stack([
        -torch.log(torch.rand(vocab, generator=r.generator, device=dev, dtype=torch.float32)) for r in rs
    ])  # [R, V]
    tokens[sel] = torch.argmax(probs / q, dim=-1)
    return tokens
