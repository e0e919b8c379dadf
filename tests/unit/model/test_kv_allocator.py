"""Block allocator: never hands out a block twice, never over-allocates, frees everything it took."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model.config import PRESETS
from shared.model.kv_cache import BlockAllocator, OutOfBlocksError, PagedKVCache

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 70)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_allocator_invariants(seq_ops):
    a = BlockAllocator(20, 8)
    for op, s, n in seq_ops:
        seq = f"s{s}"
        if op == "alloc":
            before = {k: list(a.block_table(k)) for k in a.sequences()}
            free_before = a.blocks_free
            if a.can_allocate(n, seq):
                table = a.allocate(seq, n)
                assert len(table) >= a.blocks_for(n)
            else:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(seq, n)
                assert a.blocks_free == free_before and {k: a.block_table(k) for k in a.sequences()} == before
        else:
            held = len(a.block_table(seq)) if a.holds(seq) else 0
            assert a.free(seq) == held
        used = [b for k in a.sequences() for b in a.block_table(k)]
        assert len(used) == len(set(used)), "a block is in two tables"
        assert len(used) + a.blocks_free == a.blocks_total
        assert all(0 <= b < 20 for b in used)
    for k in a.sequences():
        a.free(k)
    assert a.blocks_free == a.blocks_total


def test_growth_and_block_arithmetic():
    a = BlockAllocator(4, 16, bytes_per_block=123)
    assert a.blocks_for(1) == 1 and a.blocks_for(16) == 1 and a.blocks_for(17) == 2
    assert a.allocate("x", 17) == [0, 1]
    assert a.allocate("x", 20) == [0, 1]  # already covered
    assert a.allocate("x", 33) == [0, 1, 2]
    assert not a.can_allocate(33) and a.can_allocate(16)
    assert a.bytes_per_block == 123
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)


def test_paged_cache_slots_and_bytes():
    cfg = PRESETS["tiny"]
    kv = PagedKVCache(cfg, 6, 4)
    assert kv.bytes_per_block == 4 * cfg.kv_bytes_per_token()
    assert kv.k[0].shape == (cfg.num_key_value_heads, 24, cfg.head_dim)
    kv.allocate("a", 4)
    kv.allocate("b", 8)
    kv.free("a")
    kv.allocate("c", 12)  # gets block 0 back, then 3 and 4: not consecutive
    assert kv.allocator.block_table("c") == [0, 3, 4]
    assert kv.slot("c", 5) == 3 * 4 + 1
    assert kv.seq_slots("c").tolist() == kv.slots("c", 0, 12)
    assert kv.contiguous_start("c") is None and kv.contiguous_start("b") == 4
    partial = PagedKVCache(cfg, 6, 4, layers=[2])
    assert list(partial.k) == [2] and partial.bytes_per_block == kv.bytes_per_block // cfg.num_hidden_layers
