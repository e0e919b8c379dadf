"""Paged KV cache: a block allocator with per-sequence block tables, and the K/V tensors it indexes.

The cache of one layer is a ``[kv_heads, num_blocks * block_size, head_dim]`` tensor indexed by *slot*
(kv head major, so attention over one sequence's consecutive slots is a strided view, no copy);
a sequence's token at position ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

import torch

from shared.model.config import ModelConfig


class OutOfBlocksError(RuntimeError):
    """An allocation asked for more KV blocks than are free."""


class BlockAllocator:
    """Free list of fixed-size KV blocks plus the block table of every sequence."""

    def __init__(self, num_blocks: int, block_size: int, bytes_per_block: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self._total = num_blocks
        self._bytes_per_block = bytes_per_block
        # pop() from the end hands out low block ids first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def blocks_total(self) -> int:
        return self._total

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_block(self) -> int:
        return self._bytes_per_block

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` positions."""
        return -(-n_tokens // self.block_size)

    def _missing(self, seq: str | None, n_tokens: int) -> int:
        have = len(self._tables.get(seq, ())) if seq is not None else 0
        return max(0, self.blocks_for(n_tokens) - have)

    def can_allocate(self, n_tokens: int, seq: str | None = None) -> bool:
        """Whether ``seq`` (or a new sequence) can grow to cover ``n_tokens`` positions now."""
        return self._missing(seq, n_tokens) <= len(self._free)

    def allocate(self, seq: str, n_tokens: int) -> list[int]:
        """Grow ``seq``'s block table to cover ``n_tokens`` positions; returns the table (a copy)."""
        need = self._missing(seq, n_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(f"sequence {seq!r} needs {need} more KV blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq, [])
        for _ in range(need):
            table.append(self._free.pop())
        return list(table)

    def block_table(self, seq: str) -> list[int]:
        """The blocks of ``seq`` in position order (``KeyError`` if it holds none)."""
        return self._tables[seq]

    def holds(self, seq: str) -> bool:
        return seq in self._tables

    def free(self, seq: str) -> int:
        """Return all of ``seq``'s blocks to the free list; returns how many (0 if it held none)."""
        table = self._tables.pop(seq, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def sequences(self) -> list[str]:
        return list(self._tables)


class PagedKVCache:
    """K and V tensors of every layer whose attention runs here, indexed by slot, plus the allocator.

    ``layers`` limits the tensors to some layers (a partial model holding only some ``attn[l]`` segments);
    ``bytes_per_block`` always counts only the layers held.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, *,
                 layers: list[int] | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        self.layers = list(range(cfg.num_hidden_layers)) if layers is None else sorted(layers)
        dtype = self.dtype = dtype or getattr(torch, cfg.dtype)
        kvh, hd = cfg.num_key_value_heads, cfg.head_dim
        slots = num_blocks * block_size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            self.k[layer] = torch.zeros(kvh, slots, hd, dtype=dtype, device=device)
            self.v[layer] = torch.zeros(kvh, slots, hd, dtype=dtype, device=device)
        elem = torch.tensor([], dtype=dtype).element_size()
        per_block = 2 * len(self.layers) * block_size * kvh * hd * elem
        self.allocator = BlockAllocator(num_blocks, block_size, per_block)
        self.block_size = block_size
        self.device = torch.device(device)
        self._slot_cache: dict[str, torch.Tensor] = {}
        self._start_cache: dict[str, int | None] = {}
        self._offsets = torch.arange(block_size, device=device)

    def allocate(self, seq: str, n_tokens: int) -> list[int]:
        """Reserve blocks so ``seq`` covers ``n_tokens`` positions (see :meth:`BlockAllocator.allocate`)."""
        self._slot_cache.pop(seq, None)
        self._start_cache.pop(seq, None)
        return self.allocator.allocate(seq, n_tokens)

    def free(self, seq: str) -> int:
        """Release ``seq``'s blocks; returns how many."""
        self._slot_cache.pop(seq, None)
        self._start_cache.pop(seq, None)
        return self.allocator.free(seq)

    def contiguous_start(self, seq: str) -> int | None:
        """First slot of ``seq`` when its blocks are consecutive (its slots are one range), else None."""
        if seq in self._start_cache:
            return self._start_cache[seq]
        table = self.allocator.block_table(seq)
        start = table[0] * self.block_size if all(b == table[0] + i for i, b in enumerate(table)) else None
        self._start_cache[seq] = start
        return start

    def seq_slots(self, seq: str) -> torch.Tensor:
        """Slot index of every position ``seq`` holds blocks for, as a long tensor (memoized)."""
        slots = self._slot_cache.get(seq)
        if slots is None:
            table = torch.tensor(self.allocator.block_table(seq), dtype=torch.long, device=self.device)
            slots = (table.unsqueeze(1) * self.block_size + self._offsets).reshape(-1)
            self._slot_cache[seq] = slots
        return slots

    @property
    def bytes_per_block(self) -> int:
        return self.allocator.bytes_per_block

    def slot(self, seq: str, position: int) -> int:
        """The slot of ``seq``'s token at ``position`` (its block must be allocated)."""
        table = self.allocator.block_table(seq)
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: str, start: int, end: int) -> list[int]:
        """Slots of positions ``[start, end)`` of ``seq``."""
        table, bs = self.allocator.block_table(seq), self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
