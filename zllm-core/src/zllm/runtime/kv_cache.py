"""Paged KV cache: fixed-size blocks, per-sequence block tables, a free list.

Memory is ``num_layers`` pairs of ``[NB, BS, Hkv, D]`` tensors allocated once. A
sequence holds an opaque :class:`SeqKV` handle; the cache hands out slots (``block * BS +
offset``) for new tokens, which the attention kernel writes. No state is global: each
engine owns its cache (vLLM's PagedAttention, Kwon et al. 2023).
"""

from __future__ import annotations

import math

import torch

from zllm.spec.errors import ZllmError


class OutOfKVBlocks(ZllmError):
    """The KV cache has no free block left for a sequence."""


class SeqKV:
    """Opaque per-sequence handle: its block table and how many tokens are cached."""

    __slots__ = ("blocks", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_tokens = 0


class PagedKVCache:
    """Block-paged KV storage for every layer of one model.

    Args:
        num_layers, num_kv_heads, head_dim: model geometry.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: storage of the cache tensors.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        assert num_blocks > 0 and block_size > 0
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: SeqKV, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_new_tokens`` more tokens."""
        return max(0, math.ceil((seq.num_tokens + num_new_tokens) / self.block_size) - len(seq.blocks))

    def can_append(self, seq: SeqKV, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def append(self, seq: SeqKV, num_new_tokens: int) -> list[int]:
        """Reserve slots for ``num_new_tokens`` new tokens of ``seq`` and return them.

        Raises:
            OutOfKVBlocks: the pool cannot hold them (nothing is reserved then).
        """
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise OutOfKVBlocks(f"KV cache full: need {need} more blocks, {len(self._free)} free of {self.num_blocks}")
        seq.blocks.extend(self._free.pop() for _ in range(need))
        bs, start = self.block_size, seq.num_tokens
        slots = [seq.blocks[p // bs] * bs + p % bs for p in range(start, start + num_new_tokens)]
        seq.num_tokens += num_new_tokens
        return slots

    def truncate(self, seq: SeqKV, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` cached tokens of ``seq``; free blocks past them."""
        assert 0 <= num_tokens <= seq.num_tokens
        keep = math.ceil(num_tokens / self.block_size)
        self._free.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]
        seq.num_tokens = num_tokens

    def free(self, seq: SeqKV) -> None:
        """Evict ``seq`` entirely."""
        self.truncate(seq, 0)

    def block_table(self, seqs: list[SeqKV], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[S, MB]`` block ids per sequence, padded with -1."""
        width = max((len(s.blocks) for s in seqs), default=0)
        rows = [s.blocks + [-1] * (width - len(s.blocks)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int64, device=device).view(len(seqs), width)
