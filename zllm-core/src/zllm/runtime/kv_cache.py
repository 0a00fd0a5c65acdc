"""Paged KV cache: fixed-size blocks, per-sequence block tables, a free list.

Memory follows the model's :class:`~zllm.domain.kv_cache.KVCacheSpec`: per layer, one
``[NB, BS, Hc, Dc]`` tensor per cached tensor the layer declares (K and V for GQA, one
latent for MLA), allocated once; every layer shares the block tables. A sequence holds an
opaque :class:`SeqKV` handle; the cache hands out slots (``block * BS + offset``) for new
tokens, which the attention kernels write. No state is global: each engine owns its cache
(vLLM's PagedAttention, Kwon et al. 2023).

Sliding window: when every layer of the model attends only to the last ``W`` tokens
(:attr:`PagedKVCache.sliding_window`, the spec's ``evictable_window``),
:meth:`PagedKVCache.append` first returns to the free list the blocks of
the sequence that lie wholly before key ``num_tokens - W + 1 - lag`` — the oldest key the
next query may read, ``lag`` tokens late (:attr:`PagedKVCache.eviction_lag`). Their
block-table entries become -1 (the sliding attention kernels never read them) and
``SeqKV.num_evicted`` counts them. The lag is the most tokens a step may append and then roll
back (speculative decoding's lookahead), so a rollback never needs a block the window already
freed: :meth:`PagedKVCache.truncate` drops tail blocks only. A sequence that lost blocks
cannot be cut back to an earlier prefix, so the prefix cache does not park it (see
``zllm.runtime.scheduler.PrefixCache.park``). Models mixing full and sliding layers keep
every block.
"""

from __future__ import annotations

import math

import torch

from zllm.domain.kv_cache import KVCacheSpec
from zllm.spec.errors import ZllmError


class OutOfKVBlocks(ZllmError):
    """The KV cache has no free block left for a sequence."""


class SeqKV:
    """Opaque per-sequence handle: its block table and how many tokens are cached."""

    __slots__ = ("blocks", "num_tokens", "num_evicted")

    def __init__(self) -> None:
        self.blocks: list[int] = []  # -1 where a sliding window freed the block
        self.num_tokens = 0
        self.num_evicted = 0  # blocks freed because they fell out of the sliding window


class PagedKVCache:
    """Block-paged KV storage for every layer of one model.

    Args:
        spec: what each layer caches per token (the model's ``kv_spec``).
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: storage of the cache tensors.

    Attributes:
        layers: per layer, the tuple of its cache tensors ``[NB, BS, Hc, Dc]`` in the order
            its :class:`~zllm.domain.kv_cache.KVLayerSpec` declares them.
        nbytes: bytes of every cache tensor together (``spec.block_bytes`` per block).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", eviction_lag: int = 0):
        assert num_blocks > 0 and block_size > 0
        self.spec = spec
        self.block_size, self.num_blocks = block_size, num_blocks
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((num_blocks, block_size, t.num_heads, t.head_dim), dtype=dtype, device=device)
                  for t in layer.tensors)
            for layer in spec.layers
        ]
        self.nbytes = num_blocks * spec.block_bytes(block_size, dtype.itemsize)
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        #: Window of a model whose every layer is sliding (see the module docstring); None keeps all blocks.
        self.sliding_window: int | None = spec.evictable_window
        #: Tokens a sliding window evicts late, so a rollback of that many tokens keeps every key it needs.
        self.eviction_lag = eviction_lag

    def _outside_window(self, seq: SeqKV) -> list[int]:
        """Indices in ``seq.blocks`` of held blocks that end before key ``num_tokens - W + 1``."""
        if self.sliding_window is None:
            return []
        dead = max(0, seq.num_tokens - self.sliding_window + 1 - self.eviction_lag) // self.block_size
        return [i for i in range(min(dead, len(seq.blocks))) if seq.blocks[i] >= 0]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: SeqKV, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_new_tokens`` more tokens."""
        return max(0, math.ceil((seq.num_tokens + num_new_tokens) / self.block_size) - len(seq.blocks))

    def can_append(self, seq: SeqKV, num_new_tokens: int, reserved: int = 0) -> bool:
        """Whether ``append(seq, num_new_tokens)`` would succeed with ``reserved`` free blocks
        already promised to other sequences (a scheduler planning one step)."""
        return self.blocks_needed(seq, num_new_tokens) + reserved <= len(self._free) + len(self._outside_window(seq))

    def append(self, seq: SeqKV, num_new_tokens: int) -> list[int]:
        """Reserve slots for ``num_new_tokens`` new tokens of ``seq`` and return them.

        Raises:
            OutOfKVBlocks: the pool cannot hold them (nothing is reserved then).
        """
        for i in self._outside_window(seq):
            self._free.append(seq.blocks[i])
            seq.blocks[i] = -1
            seq.num_evicted += 1
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise OutOfKVBlocks(f"KV cache full: need {need} more blocks, {len(self._free)} free of {self.num_blocks}")
        seq.blocks.extend(self._free.pop() for _ in range(need))
        bs, start = self.block_size, seq.num_tokens
        slots = [seq.blocks[p // bs] * bs + p % bs for p in range(start, start + num_new_tokens)]
        seq.num_tokens += num_new_tokens
        return slots

    def truncate(self, seq: SeqKV, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens of ``seq``; free blocks past them (a
        rejected speculative run rolls back this way).

        A sequence that lost blocks to a sliding window may drop tail blocks only: every block
        from the first one dropped on must still be held (the eviction lag guarantees it for a
        rollback of up to ``eviction_lag`` tokens), else it can only be freed.
        """
        assert 0 <= num_tokens <= seq.num_tokens
        keep = math.ceil(num_tokens / self.block_size)
        assert num_tokens == 0 or all(b >= 0 for b in seq.blocks[keep:]) and \
            (seq.num_evicted == 0 or num_tokens >= seq.num_tokens - self.eviction_lag), \
            "cannot truncate a sequence into the blocks its window dropped"
        self._free.extend(b for b in reversed(seq.blocks[keep:]) if b >= 0)
        del seq.blocks[keep:]
        seq.num_tokens = num_tokens
        if num_tokens == 0:
            seq.num_evicted = 0

    def free(self, seq: SeqKV) -> None:
        """Evict ``seq`` entirely."""
        self.truncate(seq, 0)

    def block_table(self, seqs: list[SeqKV], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[S, MB]`` block ids per sequence, padded with -1."""
        rows, width = self.block_table_rows(seqs)
        return torch.tensor(rows, dtype=torch.int64, device=device).view(len(seqs), width)

    @staticmethod
    def block_table_rows(seqs: list[SeqKV]) -> tuple[list[int], int]:
        """The block table of :meth:`block_table` as a flat row-major list, and its width ``MB``."""
        width = max((len(s.blocks) for s in seqs), default=0)
        flat: list[int] = []
        for s in seqs:
            flat += s.blocks
            flat += [-1] * (width - len(s.blocks))
        return flat, width
