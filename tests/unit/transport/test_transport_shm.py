"""Shared-memory transport in one process: slots, back-pressure, stale reclaim, zero-copy, no leaked segments."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.transport import (DTYPES, ShmTransport, TransferExpired, TransferTimeout, TransportLimits,
                              reap_orphan_segments)
from shared.transport.shm import HEADER_BYTES

SHAPES = [[], [0], [1], [7, 3], [2, 3, 64]]


def shm_segments(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


@pytest.fixture
async def pair():
    a = ShmTransport("cpu0", TransportLimits(max_transfer_bytes=1 << 20, max_inflight_bytes=2 << 20,
                                             stale_after_s=0.4))
    b = ShmTransport("cpu1")
    yield a, b
    await a.close()
    await b.close()
    assert shm_segments(a.segment_prefix) == []


@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_round_trip_every_dtype_and_shape(pair, dtype):
    a, b = pair
    for i, shape in enumerate(SHAPES):
        x = (torch.randn(shape) * 1000).to(DTYPES[dtype])
        h = await a.send(x, "cpu1", f"t{i}", 1.0)
        assert (h.shape, h.dtype, h.nbytes) == (shape, dtype, x.numel() * x.element_size())
        assert torch.equal(await b.recv(h, 1.0), x)
        out = torch.empty(shape, dtype=DTYPES[dtype])
        h = await a.send(x, "cpu1", f"o{i}", 1.0)
        assert (await b.recv(h, 1.0, out=out)) is out and torch.equal(out, x)


async def test_strided_input_and_output(pair):
    a, b = pair
    x = torch.randn(64, 32).t()  # not contiguous
    out = torch.empty(64, 32).t()
    h = await a.send(x, "cpu1", "s", 1.0)
    await b.recv(h, 1.0, out=out)
    assert torch.equal(out, x)


async def test_sender_may_reuse_its_tensor_after_send(pair):
    a, b = pair
    x = torch.ones(1000)
    h = await a.send(x, "cpu1", "r", 1.0)
    x.fill_(5)
    assert torch.equal(await b.recv(h, 1.0), torch.ones(1000))


async def test_slots_are_reused_after_release(pair):
    a, b = pair
    for i in range(50):
        h = await a.send(torch.full((4096,), float(i)), "cpu1", f"t{i}", 1.0)
        assert (await b.recv(h, 1.0))[0].item() == i
    assert a.stats()["pool_bytes"] <= 2 * 16384  # one or two slots of the 16 KiB class, not fifty


async def test_full_pool_times_out_that_transfer_then_the_next_succeeds():
    a = ShmTransport("cpu0", TransportLimits(max_transfer_bytes=1 << 20, max_inflight_bytes=1 << 20,
                                             stale_after_s=30))
    b = ShmTransport("cpu1")
    try:
        held = await a.send(torch.zeros(1 << 18), "cpu1", "held", 1.0)  # fills the 1 MiB pool
        with pytest.raises(TransferTimeout):
            await a.send(torch.zeros(1 << 18), "cpu1", "waits", 0.2)
        await b.recv(held, 1.0)  # releases the slot
        h = await a.send(torch.ones(1 << 18), "cpu1", "next", 1.0)
        assert torch.equal(await b.recv(h, 1.0), torch.ones(1 << 18))
    finally:
        await a.close()
        await b.close()


async def test_stale_slot_is_reclaimed_and_a_late_reader_gets_expired(pair):
    a, b = pair
    stale = await a.send(torch.zeros(1 << 18), "cpu1", "stale", 1.0)  # nobody receives it
    await a.send(torch.zeros(1 << 18), "cpu1", "fill", 1.0)
    h = await a.send(torch.ones(1 << 18), "cpu1", "after", 2.0)  # waits for the stale reclaim (0.4 s)
    assert torch.equal(await b.recv(h, 1.0), torch.ones(1 << 18))
    with pytest.raises(TransferExpired):
        await b.recv(stale, 1.0)


async def test_zero_copy_view_until_release(pair):
    a, b = pair
    x = torch.arange(1000, dtype=torch.int32)
    h = await a.send(x, "cpu1", "zc", 1.0)
    view = await b.recv(h, 1.0, zero_copy=True)
    assert torch.equal(view, x)
    a.pool.reclaim()
    assert a.stats()["busy_slots"] == 1  # held by the receiver until release
    b.release(h)
    a.pool.reclaim()
    assert a.stats()["busy_slots"] == 0


async def test_close_unlinks_every_segment():
    a = ShmTransport("cpu0")
    for i in range(5):
        await a.send(torch.zeros(1000 * (i + 1)), "cpu1", f"t{i}", 1.0)  # busy slots of several classes
    assert len(shm_segments(a.segment_prefix)) == 5
    await a.close()
    assert shm_segments(a.segment_prefix) == []


async def test_segment_header_is_not_readable_as_data(pair):
    a, b = pair
    h = await a.send(torch.zeros(4), "cpu1", "h", 1.0)
    assert Path("/dev/shm", h.location).stat().st_size == HEADER_BYTES + 4096


def test_reap_removes_segments_of_dead_processes_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"slicesched-cpu0-p{dead_pid}-abcd1234-0"
    alive = tmp_path / "slicesched-cpu0-p1-abcd1234-0"  # pid 1 exists
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert reap_orphan_segments(tmp_path) == [orphan.name]
    assert not orphan.exists() and alive.exists()
