"""The live scheduler's lease commits (services/scheduler/policy_bridge.py LeaseManager) against a real Redis: one GMG
commit stages and leases, grants of one decision commit concurrently and are announced to both workers, and a
stale view of what is resident falls back to staging first."""
from __future__ import annotations

import pytest

from services.scheduler.policy_bridge import LeaseManager
from shared.codec import decode
from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Refused, Reservation
from shared.gmg.lease_store import LeaseStore
from shared.messages import LeaseGranted, WorkerMsg, worker_stream
from shared.policies import GrantLease, RevokeLease
from shared.streams import StreamProducer, entry_payload
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.05},
                         "devices": [{"id": d, "backend": "emulated", "memory_gb": 0.25} for d in ("h0", "g0", "g1")]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10}, "home_devices": ["h0"]},
    {"name": "b", "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10}, "home_devices": ["g0"]},
    {"name": "c", "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10}, "home_devices": ["g1"]}]})


def _grant(guest: str, segs=("mlp[0]", "mlp[1]"), memory: int = 1 << 20) -> GrantLease:
    return GrantLease("a", "h0", guest, tuple(segs), 30.0, 0.5, memory)


async def _gmg_state(redis, store, device: str) -> list:
    """Everything a commit on ``device`` could change: the epoch, its row, reservations, residency and pins."""
    k = store.keys
    pipe = redis.pipeline(transaction=False)
    pipe.get(k.epoch)
    for key in (k.device(device), k.reservations(device), k.resident(device), k.pins(device)):
        pipe.hgetall(key)
    return await pipe.execute()


async def _granted(redis, prefix, device: str) -> list[LeaseGranted]:
    out = []
    for _, f in await redis.xrange(worker_stream(prefix, device)):
        m = decode(entry_payload(f), WorkerMsg)
        if isinstance(m, LeaseGranted):
            out.append(m)
    return out


async def test_grants_commit_concurrently_and_stale_residency_falls_back(redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    mgr = LeaseManager(prefix, store, StreamProducer(redis), TENANTS)
    epoch0 = await store.epoch()
    # one decision, three grants: two on g0 sharing mlp[0] (one of them stages it, the other finds it resident),
    # one on g1
    await mgr.apply([_grant("g0"), _grant("g0", ("mlp[0]", "mlp[2]")), _grant("g1")], now=100.0)
    assert mgr.granted == 3 and mgr.refused == 0 and len(mgr.active) == 3
    ls = LeaseStore(store)
    assert len(await ls.active("g0")) == 2 and len(await ls.active("g1")) == 1
    res = await store.reservations("g0")
    assert {o for o in res if o.startswith("weights:a:")} == {"weights:a:mlp[0]", "weights:a:mlp[1]",
                                                               "weights:a:mlp[2]"}
    # each lease announced once to its guest and once to the home
    assert len(await _granted(redis, prefix, "g0")) == 2 and len(await _granted(redis, prefix, "g1")) == 1
    assert len(await _granted(redis, prefix, "h0")) == 3
    assert await store.epoch() > epoch0

    # the weights on g1 are evicted behind the scheduler's back: its next grant there stages them again
    lid = next(lid for lid, st in mgr.active.items() if st.guest_device == "g1")
    await mgr.apply([RevokeLease(lid, "test")], now=101.0)
    assert isinstance(await ls.evict("g1", "a", ["mlp[0]", "mlp[1]"]), int)
    st = await mgr.grant(_grant("g1"), now=102.0)
    assert st is not None and mgr.granted == 4
    assert "weights:a:mlp[0]" in await store.reservations("g1")

    # a lease that cannot fit is refused cleanly: no lease, no message
    row = await store.device("g1")
    free = int(row["limit"]) - int(row["reserved"])
    assert isinstance(await store.reserve([Reservation("g1", "kv:filler", "kv", "c", free - 1)]), int)
    before = len(await _granted(redis, prefix, "h0"))
    assert await mgr.grant(_grant("g1", ("mlp[3]",)), now=103.0) is None
    assert mgr.refused == 1 and len(await _granted(redis, prefix, "h0")) == before


async def test_cached_weights_of_ended_leases_are_evicted_to_make_room(redis, prefix):
    """Weights staged for leases that ended stay cached on the guest (no lease pins them); a grant that needs the
    memory evicts them, least recently leased first, never the device's home weights nor the weights of an
    active lease. The snapshot counts them as evictable, as the simulator does."""
    from shared.gmg.lease_store import unpinned_entries

    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    await store.reserve([Reservation("g0", "weights:b:home", "weights", "b", 1 << 20)])
    mgr = LeaseManager(prefix, store, StreamProducer(redis), TENANTS, activation_bytes=4096)
    ls = LeaseStore(store)
    old = GrantLease("a", "h0", "g0", ("mlp[0]",), 30.0, 0.5, 1 << 20)
    newer = GrantLease("c", "g1", "g0", ("mlp[1]",), 30.0, 0.5, 1 << 20)
    pinned = GrantLease("a", "h0", "g0", ("mlp[2]",), 30.0, 0.5, 1 << 20)
    for i, g in enumerate((old, newer, pinned)):
        assert await mgr.grant(g, now=100.0 + i) is not None
    for lid in [lid for lid, st in mgr.active.items() if st.segments != ("mlp[2]",)]:
        await mgr.revoke(lid, "test")  # mlp[0] of a, then mlp[1] of c: both cached, unpinned
    cached = {(t, s) for t, s, _ in await ls.unpinned("g0", ("b",))}
    assert cached == {("a", "mlp[0]"), ("c", "mlp[1]")}  # mlp[2] is pinned by its active lease
    # fill the device so that a new lease does not fit without one of the cached segments
    row = await store.device("g0")
    free = int(row["limit"]) - int(row["reserved"])
    seg = mgr._seg_bytes["a"]["mlp[0]"]
    assert isinstance(await store.reserve([Reservation("g0", "kv:filler", "kv", "b", free - seg // 2)]), int)
    st = await mgr.grant(GrantLease("c", "g1", "g0", ("mlp[3]",), 30.0, 0.5, 1 << 20), now=110.0)
    assert st is not None and mgr.evicted == 1
    left = {(t, s) for t, s, _ in await ls.unpinned("g0", ("b",))}
    assert ("a", "mlp[0]") not in left  # the least recently leased one went first
    assert "weights:a:mlp[2]" in await store.reservations("g0")  # the active lease's weights stayed
    # a grant that evicting every cached segment would not make fit: refused, the cache kept, nothing changed
    row = await store.device("g0")
    free = int(row["limit"]) - int(row["reserved"])
    assert isinstance(await store.reserve([Reservation("g0", "kv:filler2", "kv", "b", free)]), int)
    before = await _gmg_state(redis, store, "g0")
    assert await mgr.grant(GrantLease("a", "h0", "g0", ("mlp[1]",), 30.0, 0.5, 1 << 20), now=111.0) is None
    assert mgr.refused == 1 and mgr.evicted == 1 and await _gmg_state(redis, store, "g0") == before
    assert ("c", "mlp[1]") in {(t, s) for t, s, _ in await ls.unpinned("g0", ("b",))}
    # the snapshot's evictable bytes: unpinned staged weights, home tenant left out
    k = store.keys
    res, pins = await redis.hgetall(k.resident("g0")), await redis.hgetall(k.pins("g0"))
    assert sum(n for _, _, n in unpinned_entries(res, pins, ("b",))) == sum(
        n for _, _, n in await ls.unpinned("g0", ("b",))) > 0
    # a request's KV reservation makes room the same way (the scheduler's admission: LeaseManager.room)
    res = await store.commit_making_room("reserve", [Reservation("g0", "kv:r1", "kv", "b", 4096)], [mgr.room("g0")])
    assert not isinstance(res, Refused) and [e[:3] for e in res.evicted] == [("g0", "c", "mlp[1]")]
    mgr.note_evicted(res.evicted)
    assert mgr.evicted == 2 and ("g0", "c", "mlp[1]") not in mgr._resident
    assert "kv:r1" in await store.reservations("g0") and "weights:c:mlp[1]" not in await store.reservations("g0")


async def test_the_gmg_lease_record_keeps_the_grants_mode_and_share(redis, prefix):
    """What `slicesched inspect leases` and the simulator service's twin read back: before 2026-12-01 every live
    lease was recorded as a `segments` lease with share 1.0, whatever was granted."""
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    mgr = LeaseManager(prefix, store, StreamProducer(redis), TENANTS)
    seq = GrantLease("a", "h0", "g0", ("*",), 5.0, 0.35, 1 << 20, mode="sequences")
    await mgr.apply([seq, GrantLease("a", "h0", "g1", ("mlp[0]",), 5.0, 0.6, 1 << 20)], now=100.0)
    ls = LeaseStore(store)
    (on_g0,), (on_g1,) = await ls.active("g0"), await ls.active("g1")
    assert (on_g0.mode, on_g0.segments, on_g0.share) == ("sequences", ("*",), 0.35)
    assert (on_g1.mode, on_g1.segments, on_g1.share) == ("segments", ("mlp[0]",), 0.6)
    assert {m.mode for m in await _granted(redis, prefix, "g0")} == {"sequences"}
