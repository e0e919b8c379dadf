"""A follower rebuilds the full GMG from Redis: snapshot + change stream equals the live state, after restarts and
after gaps in the stream; epochs on the change stream are contiguous and increasing."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Reservation
from shared.gmg.follower import GMGFollower, read_mirror
from shared.gmg.lease_store import Lease, LeaseStore
from shared.messages import RequestStarted, StepReport, WorkerHeartbeat
from shared.redis_util import command_client
from services.gmg.core import GMGCore

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"devices": [{"id": f"d{i}", "backend": "emulated", "memory_bytes": 1_000_000}
                                     for i in range(3)]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d0"]},
    {"name": "b", "model": "tiny-2l", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d1"]}]})


async def _workload(store: GMGStore, i0: int = 0) -> None:
    """A bit of everything the GMG records: reservations, resizes, staging, leases, events."""
    leases, core, now = LeaseStore(store), GMGCore(store.keys, ["d0", "d1", "d2"]), time.time()
    for i in range(i0, i0 + 6):
        await store.reserve([Reservation(f"d{i % 3}", f"kv:{i}", "kv", "a", 1000 + i)])
        await store.resize(f"d{i % 3}", f"kv:{i}", 3000 + i)
    await leases.stage("d2", "a", {"mlp[0]": 5000})
    await leases.commit(Lease(f"L{i0}", "a", "d2", ("mlp[0]",), now, now + 60, 777, "d0"))
    for ev in (WorkerHeartbeat(msg_id="h", device="d0", worker_id="w", backend="emulated", home_tenant="a", ts=now),
               StepReport(msg_id="s", device="d0", tenant="a", window_start_ts=now - 1, window_end_ts=now, steps=3,
                          busy_ms=20.0, busy_intervals=[(now - 0.5, now - 0.4)]),
               RequestStarted(msg_id="r", request_id=f"q{i0}", tenant="a", device="d0", ts=now)):
        op, batch = core.on_event(ev, now)
        await store.apply(op, batch)
    await store.release("d1", f"kv:{i0 + 1}")
    await leases.close(f"L{i0}", "revoked")


async def test_follower_rebuild_equals_live_state(redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    live = GMGFollower(redis, prefix)
    await live.load()
    await _workload(store)
    await live.catch_up()
    assert live.snapshot.epoch == live.epoch  # a snapshot now; the next one re-parses only changed keys
    await _workload(store, 100)
    await live.catch_up()
    mirror, epoch, _ = await read_mirror(redis, store.keys)
    assert live.epoch == epoch and live.mirror == mirror
    restarted = GMGFollower(redis, prefix)  # a process started after everything happened
    await restarted.load()
    assert restarted.mirror == live.mirror and restarted.snapshot == live.snapshot
    snap = live.snapshot
    assert snap.kv_location("3") == [("d0", 3003)] and snap.holders("a", "mlp[0]") == ["d0", "d2"]
    assert snap.devices["d2"].reserved == 5000 + 3002 + 3005 + 3101 + 3104 and not snap.leases
    assert snap.requests["d0"]["q0"].tenant == "a" and snap.busy["d0"]
    assert live.reloads == 1 and live.applied > 0


async def test_follower_reloads_after_a_gap(redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    f = GMGFollower(redis, prefix)
    await f.load()
    await _workload(store)
    await redis.xtrim(store.keys.changes, maxlen=2)  # the follower fell behind a trimmed stream
    await _workload(store, 50)
    await f.catch_up()
    mirror, epoch, _ = await read_mirror(redis, store.keys)
    assert f.reloads == 2 and f.epoch == epoch and f.mirror == mirror


async def test_change_stream_epochs_contiguous_under_concurrency(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    follower = GMGFollower(redis, prefix)
    await follower.load()
    clients = [command_client(redis_url) for _ in range(8)]
    await asyncio.gather(*(_workload(GMGStore(c, prefix), 1000 * (i + 1)) for i, c in enumerate(clients)))
    for c in clients:
        await c.aclose()
    entries = await redis.xrange(store.keys.changes)
    epochs = [int(f[b"epoch"]) for _, f in entries]
    assert epochs == list(range(1, len(epochs) + 1)) and epochs[-1] == await store.epoch()
    await follower.catch_up()
    mirror, _, _ = await read_mirror(redis, store.keys)
    assert follower.reloads == 1 and follower.mirror == mirror


async def test_paced_follower_takes_a_burst_of_changes_in_few_reads(redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    f = GMGFollower(redis, prefix, block_ms=100, min_interval_s=0.25)
    await f.load()
    polls = 0
    orig = f.poll

    async def counting_poll(*a, **kw):
        nonlocal polls
        polls += 1
        return await orig(*a, **kw)

    f.poll = counting_poll
    stop = asyncio.Event()
    task = asyncio.create_task(f.run(stop))
    for i in range(10):  # one change every 20 ms: unpaced, about one read each
        await store.reserve([Reservation("d0", f"kv:{i}", "kv", "a", 100 + i)])
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.4)
    stop.set()
    await task
    mirror, epoch, _ = await read_mirror(redis, store.keys)
    assert f.epoch == epoch and f.mirror == mirror  # nothing missed
    assert polls <= 4
