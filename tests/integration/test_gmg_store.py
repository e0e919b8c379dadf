"""GMG memory safety at commit, against a real redis-server, including concurrent committers."""
from __future__ import annotations

import asyncio

import pytest

from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Refused, Reservation
from shared.redis_util import command_client

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.1},
                         "devices": [{"id": "d0", "backend": "cpu", "memory_bytes": 1000},
                                     {"id": "d1", "backend": "cpu", "memory_bytes": 1000}]})
TENANTS = parse_tenants({"tenants": [{"name": "a", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1},
                                      "home_devices": ["d0"]}]})


async def test_reserve_refuses_over_limit_and_is_all_or_nothing(redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    assert isinstance(await store.reserve([Reservation("d0", "kv:1", "kv", "a", 800)]), int)
    r = await store.reserve([Reservation("d1", "kv:2", "kv", "a", 100), Reservation("d0", "kv:3", "kv", "a", 200)])
    assert isinstance(r, Refused) and r.reason == "insufficient_memory" and r.device == "d0"
    assert (await store.device("d1"))["reserved"] == "0"  # nothing reserved on d1 either
    assert isinstance(await store.reserve([Reservation("d0", "kv:1", "kv", "a", 1)]), Refused)  # duplicate owner
    assert await store.release("d0", "kv:1") == 800
    assert await store.release("d0", "kv:1") == 0  # idempotent
    assert (await store.device("d0"))["reserved"] == "0"


async def test_concurrent_committers_never_exceed_limit(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    clients = [command_client(redis_url) for _ in range(16)]
    results: list = []

    async def committer(i: int, c) -> None:
        s = GMGStore(c, prefix)
        for j in range(25):
            res = await s.reserve([Reservation(f"d{(i + j) % 2}", f"kv:{i}:{j}", "kv", "a", 7 + (i * j) % 13)])
            results.append(res)
            if j % 3 == 0 and not isinstance(res, Refused):
                await s.release(f"d{(i + j) % 2}", f"kv:{i}:{j}")

    await asyncio.gather(*(committer(i, c) for i, c in enumerate(clients)))
    for c in clients:
        await c.aclose()
    refused = [r for r in results if isinstance(r, Refused)]
    assert refused and all(r.reason == "insufficient_memory" for r in refused)
    for d in ("d0", "d1"):
        dev = await store.device(d)
        total = sum(r.nbytes for r in (await store.reservations(d)).values())
        assert int(dev["reserved"]) == total <= int(dev["limit"]) == 900


async def test_concurrent_mixed_committers_account_for_every_byte(redis_url, redis, prefix):
    """16 clients race multi-device admissions, KV growth, releases and leases; a monitor samples every device
    while they run. Never over the limit; every call returns an epoch or a refusal; the final reservations are
    exactly the granted minus the released."""
    from shared.gmg import Resize
    from shared.gmg.lease_store import Lease, LeaseStore

    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    await LeaseStore(store).stage("d1", "a", {"mlp[0]": 100})
    clients = [command_client(redis_url) for _ in range(16)]
    granted: dict[str, dict[str, int]] = {"d0": {}, "d1": {"weights:a:mlp[0]": 100}}
    outcomes: list = []
    done = asyncio.Event()
    peaks = {"d0": 0, "d1": 0}

    async def monitor() -> None:
        while not done.is_set():
            for d in ("d0", "d1"):
                peaks[d] = max(peaks[d], int((await store.device(d))["reserved"]))
            await asyncio.sleep(0)

    async def committer(i: int, c) -> None:
        s, leases = GMGStore(c, prefix), LeaseStore(GMGStore(c, prefix))
        for j in range(20):
            size = 5 + (i * 7 + j * 3) % 40
            if j % 4 == 3:  # a lease on d1
                lease = Lease(f"L{i}-{j}", "a", "d1", ("mlp[0]",), 0.0, 1.0, size)
                res = await leases.commit(lease)
                outcomes.append(res)
                if not isinstance(res, Refused):
                    if j % 8 == 7:
                        assert await leases.close(lease.lease_id) == lease
                    else:
                        granted["d1"][f"lease:{lease.lease_id}"] = size
                continue
            items = [Reservation("d0", f"kv:{i}:{j}", "kv", "a", size),
                     Reservation("d1", f"kv:{i}:{j}", "kv", "a", size // 2)]
            res = await s.reserve(items)
            outcomes.append(res)
            if isinstance(res, Refused):
                continue
            granted["d0"][items[0].owner], granted["d1"][items[1].owner] = size, size // 2
            res = await s.commit("resize", [Resize("d0", items[0].owner, size * 2)])  # KV growth
            outcomes.append(res)
            if not isinstance(res, Refused):
                granted["d0"][items[0].owner] = size * 2
            if j % 3 == 0:
                for d in ("d0", "d1"):
                    assert await s.release(d, items[0].owner) == granted[d].pop(items[0].owner)

    mon = asyncio.create_task(monitor())
    await asyncio.gather(*(committer(i, c) for i, c in enumerate(clients)))
    done.set()
    await mon
    for c in clients:
        await c.aclose()
    refused = [r for r in outcomes if isinstance(r, Refused)]
    assert refused and all(r.reason == "insufficient_memory" for r in refused)
    assert all(isinstance(r, (int, Refused)) for r in outcomes)
    for d in ("d0", "d1"):
        dev = await store.device(d)
        held = {o: r.nbytes for o, r in (await store.reservations(d)).items()}
        assert held == granted[d]
        assert int(dev["reserved"]) == sum(held.values()) <= int(dev["limit"]) == 900
        assert peaks[d] <= 900
