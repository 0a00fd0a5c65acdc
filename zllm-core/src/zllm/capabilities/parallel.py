"""The parallel context: which shard of a model this process holds, and the collectives
that join the shards (torch.distributed over the backend's process-group backend).

A family receives a :class:`ParallelContext` in ``tensor_specs`` and ``build`` and calls
its collectives from its forward; with :data:`SINGLE` (one process) every collective is the
identity, so one layer code serves both. Collectives are what a backend provides: its
``process_group_backend`` names torch's backend for them (``gloo`` on a CPU, ``nccl`` on
CUDA and on ROCm, where RCCL answers to that name).

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, §3): a
column-parallel weight is split by output rows, a row-parallel one by input columns and
followed by :meth:`ParallelContext.all_reduce`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from zllm.spec.errors import ConfigError
from zllm.spec.tensor_spec import Shard


@attrs.frozen
class ParallelContext:
    """This process's place among the ranks of one engine replica.

    Ranks are numbered stage-major: global rank ``pp_rank * tp_size + tp_rank``.

    Attributes:
        tp_rank, tp_size: rank within the tensor-parallel group and that group's size.
        group: the torch.distributed process group of the tensor-parallel ranks; ``None``
            when ``tp_size`` is 1, or for a context that only plans shards (``tensor_specs``
            checked before any process group exists) and never runs a collective.

        pp_rank, pp_size: this rank's pipeline stage and the number of stages.
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    pp_rank: int = 0
    pp_size: int = 1

    def __attrs_post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert 0 <= self.pp_rank < self.pp_size, (self.pp_rank, self.pp_size)

    @property
    def first_stage(self) -> bool:
        """This rank's stage takes token ids (the embedding lives here)."""
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        """This rank's stage computes logits (final norm and ``lm_head`` live here)."""
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of this rank's tensor-parallel peer in pipeline stage ``stage``."""
        return stage * self.tp_size + self.tp_rank

    def stage_layers(self, num_layers: int) -> range:
        """This stage's contiguous layers: ``num_layers`` split into ``pp_size`` runs whose
        lengths differ by at most one (the first stages take the extra layers)."""
        assert num_layers >= self.pp_size, (num_layers, self.pp_size)
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the tensor-parallel ranks (in place; returns ``x``)."""
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, N]`` from every rank, concatenated by rank along the last dimension: ``[R, tp_size * N]``."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def embedding(self, ops: Any, weight: Any, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[T, C]`` embedding rows of ``token_ids`` ``[T]`` from this rank's vocabulary rows
        ``weight`` (:meth:`padded_split` of ``vocab_size``): each rank looks the ids up in its
        rows, zeroes the rows of ids it does not hold, and the ranks' rows are summed
        (Megatron-LM's vocabulary-parallel embedding)."""
        if self.tp_size == 1:
            return ops.embedding(weight, token_ids)  # [T, C]
        mine = self.padded_split(vocab_size)
        local = token_ids - mine.start  # [T]
        outside = (local < 0) | (local >= mine.size)
        x = ops.embedding(weight, local.masked_fill(outside, 0))  # [T, C]
        return self.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0.0))

    def logits(self, ops: Any, x: torch.Tensor, lm_head: Any, vocab_size: int) -> torch.Tensor:
        """f32 ``[S', V]`` logits of final-norm rows ``x`` ``[S', C]`` from this rank's
        vocabulary rows of ``lm_head``: each rank's columns, padded to ``ceil(V / tp)``,
        gathered, the padding cut."""
        logits = ops.linear(x, lm_head)  # [S', V / tp]
        if self.tp_size == 1:
            return logits
        width = -(-vocab_size // self.tp_size)
        if logits.shape[1] < width:  # the last ranks of a vocabulary that does not divide
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        return self.all_gather_columns(logits)[:, :vocab_size]  # [S', V]

    def prenorm_layers(
        self,
        ops: Any,
        eps: float,
        norms: Sequence[tuple[Any, Any]],
        attention: Callable[[int, torch.Tensor], torch.Tensor],
        mlp: Callable[[int, torch.Tensor], torch.Tensor],
        embed: Callable[[], torch.Tensor],
        hidden: tuple[torch.Tensor, torch.Tensor] | None,
        rows: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This stage's pre-norm decoder layers, with each residual add fused into the next
        norm (``h = x + r``, then ``norm(h)``) and this rank's partial sums all-reduced.

        ``norms[i]`` is layer ``i``'s ``(attention norm, MLP norm)`` weights; ``attention(i, x)``
        and ``mlp(i, x)`` map ``x`` f32 ``[T, C]`` to this rank's partial sum ``[T, C]``.
        The first stage starts from ``embed()`` ``[T, C]``, a later one from the previous
        stage's ``hidden`` (its last MLP output and residual). Returns that pair for the
        next stage when this is not the last stage; otherwise the final residual stream
        ``[S', C]`` at ``rows`` (int64 ``[S']``; only those rows of the last MLP are summed
        over the ranks), or every row ``[T, C]`` when ``rows`` is None. The final norm and
        ``lm_head`` are the family's.
        """
        if hidden is None:
            residual = embed()  # [T, C]
            x = ops.rms_norm(residual, norms[0][0], eps)  # a stage holds >= 1 layer
        else:
            x, residual = ops.add_rms_norm(hidden[0], hidden[1], norms[0][0], eps)
        for i, (_, mlp_norm) in enumerate(norms):
            x, residual = ops.add_rms_norm(self.all_reduce(attention(i, x)), residual, mlp_norm, eps)
            out = mlp(i, x)  # [T, C], this rank's partial sum
            if i + 1 < len(norms):
                x, residual = ops.add_rms_norm(self.all_reduce(out), residual, norms[i + 1][0], eps)
            elif not self.last_stage:
                return self.all_reduce(out), residual  # [T, C] each, for the next stage
            elif rows is None:
                residual = self.all_reduce(out) + residual  # [T, C]
            else:
                residual = self.all_reduce(out[rows]) + residual[rows]  # [S', C]
        return residual

    def split(self, size: int, dim: int = 0) -> Shard:
        """This rank's equal share of a dimension of ``size`` (``size`` divisible by ``tp_size``)."""
        assert size % self.tp_size == 0, (size, self.tp_size)
        part = size // self.tp_size
        return Shard(dim, self.tp_rank * part, part)

    def padded_split(self, size: int, dim: int = 0) -> Shard:
        """This rank's share when ``size`` is padded to a multiple of ``tp_size``: ranks hold
        ``ceil(size / tp_size)`` rows each, the last ones fewer (possibly none) — a vocabulary
        that does not divide."""
        part = -(-size // self.tp_size)
        start = min(self.tp_rank * part, size)
        return Shard(dim, start, min(part, size - start))

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """``(first KV head, KV heads held)`` for this rank's query heads: an equal split
        when ``num_kv_heads >= tp_size``, else the one KV head its query heads share
        (replicated over ``tp_size / num_kv_heads`` ranks)."""
        if num_kv_heads >= self.tp_size:
            local = num_kv_heads // self.tp_size
            return self.tp_rank * local, local
        group = num_heads // num_kv_heads  # query heads per KV head
        return self.tp_rank * (num_heads // self.tp_size) // group, 1


SINGLE = ParallelContext()
"""One process holding the whole model."""


def check_tensor_parallel(tp_size: int, *, num_heads: int, num_kv_heads: int, source: str) -> None:
    """Refuse a tensor-parallel size that does not fit a model's attention heads, before
    any weight is read.

    Raises:
        ConfigError: (``parallel.tensor``) ``tp_size`` does not divide ``num_heads``, or
            neither divides the other of ``tp_size`` and ``num_kv_heads``; names both numbers
            and the checkpoint ``source``.
    """
    if num_heads % tp_size:
        raise ConfigError("parallel.tensor", f"{tp_size} does not divide the {num_heads} attention heads of "
                                             f"{source}; use a divisor of {num_heads}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ConfigError("parallel.tensor", f"{tp_size} and the {num_kv_heads} KV heads of {source} do not "
                                             f"divide one another; KV heads are split when they are a multiple "
                                             f"of it and replicated when it is a multiple of them")


def check_stage_windows(layer_windows: tuple[int | None, ...], pp_size: int) -> None:
    """Refuse pipeline stages whose KV caches would evict differently: rank 0's one block
    allocator frees blocks outside a sliding window only when every layer it sees slides by
    the same window, and it sees only the first stage's layers.

    Args:
        layer_windows: each layer's sliding window in tokens, None for full attention.
        pp_size: the number of pipeline stages.

    Raises:
        ConfigError: (``parallel.pipeline``) a stage of only sliding layers beside one with
            full-attention layers or another window; names the stages' layers.
    """
    if pp_size == 1:
        return
    stages = [ParallelContext(pp_rank=r, pp_size=pp_size).stage_layers(len(layer_windows)) for r in range(pp_size)]
    windows = [layer_windows[s.start: s.stop] for s in stages]
    evictable = [None if None in w else max(x for x in w if x is not None) for w in windows]
    if len(set(evictable)) > 1:
        layout = "; ".join(f"layers {s.start}-{s.stop - 1}: " + ("full attention" if e is None else f"window {e}")
                           for s, e in zip(stages, evictable, strict=True))
        raise ConfigError("parallel.pipeline", f"{pp_size} stages would mix sliding-window and full-attention "
                                               f"layers ({layout}), which one KV block allocator cannot serve; "
                                               f"use another parallel.pipeline or 1")
