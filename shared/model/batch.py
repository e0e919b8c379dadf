"""Per-step batch layout: which rows belong to which sequence, where their KV goes and what they attend to.

Built once per engine step from the step's chunks and shared by every ``attn[l]`` segment. Rows are laid out
in chunk order. The leading run of one-token chunks (decode tokens) forms the *decode group*, attended in one
padded batched call; every other chunk (a prefill chunk) is attended on its own with a causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.model.kv_cache import PagedKVCache


@dataclass(frozen=True)
class SeqChunk:
    """``length`` new tokens of sequence ``seq_id`` at positions ``[start, start + length)``."""

    seq_id: str
    start: int
    length: int


@dataclass(frozen=True)
class PrefillGroup:
    """One prefill chunk: rows ``[row, row + n)`` attend to the ``gather`` slots (context of length L)."""

    row: int
    n: int
    gather: torch.Tensor | slice  # [L] slot indices, or the slot range when the sequence's blocks are consecutive
    bias: torch.Tensor | None  # [n, L] additive causal mask in the KV cache's dtype (None when n == 1)


@dataclass
class BatchContext:
    """Everything an attention segment needs besides the hidden states."""

    kv: PagedKVCache | None
    chunks: list[SeqChunk]
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor | slice  # [T] long: where each row's K/V is written (a range for one chunk)
    n_decode: int = 0
    decode_gather: torch.Tensor | slice | None = None  # [D, Lmax] slot indices (a range for one sequence)
    decode_bias: torch.Tensor | None = None  # [D, 1, Lmax] additive mask; None when all lengths are equal
    prefills: list[PrefillGroup] = field(default_factory=list)
    rope: dict = field(default_factory=dict)  # filled by the model: cos/sin rows for ``positions``

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_rows(self) -> list[int]:
        """Row index of the last token of every chunk (the rows that may be sampled)."""
        rows, r = [], 0
        for c in self.chunks:
            r += c.length
            rows.append(r - 1)
        return rows


def build_context(kv: PagedKVCache, chunks: list[SeqChunk]) -> BatchContext:
    """Lay out a batch; every chunk's sequence must already hold KV blocks for its positions."""
    if not chunks:
        raise ValueError("a batch needs at least one chunk")
    device = kv.device
    slot_rows = [kv.seq_slots(c.seq_id) for c in chunks]
    for c, slots in zip(chunks, slot_rows):
        if c.start + c.length > slots.shape[0]:
            raise ValueError(f"sequence {c.seq_id!r} holds KV for {slots.shape[0]} positions, "
                             f"needs {c.start + c.length}")
    n_dec = 0
    while n_dec < len(chunks) and chunks[n_dec].length == 1:
        n_dec += 1
    starts = [kv.contiguous_start(c.seq_id) for c in chunks]
    if len(chunks) == 1:
        c = chunks[0]
        positions = torch.arange(c.start, c.start + c.length, device=device)
        s0 = starts[0]
        slot_mapping = slot_rows[0][c.start:c.start + c.length] if s0 is None else \
            slice(s0 + c.start, s0 + c.start + c.length)
    else:
        positions = torch.cat([torch.arange(c.start, c.start + c.length) for c in chunks]).to(device)
        slot_mapping = torch.cat([s[c.start:c.start + c.length] for c, s in zip(chunks, slot_rows)])
    ctx = BatchContext(kv=kv, chunks=chunks, positions=positions, slot_mapping=slot_mapping, n_decode=n_dec)
    if n_dec:
        lens = [chunks[i].start + 1 for i in range(n_dec)]
        lmax = max(lens)
        if n_dec == 1 and starts[0] is not None:
            ctx.decode_gather = slice(starts[0], starts[0] + lmax)
        elif min(lens) == lmax:
            ctx.decode_gather = torch.stack([slot_rows[i][:lmax] for i in range(n_dec)])
        else:
            gather = torch.zeros(n_dec, lmax, dtype=torch.long, device=device)
            bias = torch.zeros(n_dec, 1, lmax, device=device)
            for i, n in enumerate(lens):
                gather[i, :n] = slot_rows[i][:n]
                bias[i, :, n:] = float("-inf")
            ctx.decode_gather, ctx.decode_bias = gather, bias
    row = sum(c.length for c in chunks[:n_dec])
    for c, slots, s0 in zip(chunks[n_dec:], slot_rows[n_dec:], starts[n_dec:]):
        ctx_len = c.start + c.length
        bias = None
        if c.length > 1:
            q_pos = torch.arange(c.start, ctx_len, device=device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)
            # in the cache's dtype: the fused attention takes the mask in the queries' dtype
            bias = torch.zeros(c.length, ctx_len, device=device, dtype=kv.dtype) \
                .masked_fill_(k_pos > q_pos, float("-inf"))
        gather = slots[:ctx_len] if s0 is None else slice(s0, s0 + ctx_len)
        ctx.prefills.append(PrefillGroup(row=row, n=c.length, gather=gather, bias=bias))
        row += c.length
    return ctx
