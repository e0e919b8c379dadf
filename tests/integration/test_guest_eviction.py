"""Staged guest weights stay cached after a lease and are evicted LRU (in the GMG too) when the device's own
tenant needs the memory; weights pinned by an active lease are kept; a re-sent grant extends the driver's link.
Real redis-server, in-process agent."""
from __future__ import annotations

import time

import pytest

from services.worker.lease_agent import LeaseAgent, LeaseOptions
from shared.config import parse_cluster, parse_tenants
from shared.gmg import GMGStore, Reservation
from shared.gmg.lease_store import Lease, LeaseStore
from shared.messages import LeaseGranted, LeaseRevoked
from shared.model.engine import Engine
from shared.model.loader import build_model

pytestmark = pytest.mark.integration

MIB = 2**20
CLUSTER = parse_cluster({"cluster": {"headroom_fraction": 0.05},
                         "devices": [{"id": "h0", "backend": "cpu", "memory_bytes": 256 * MIB},
                                     {"id": "g0", "backend": "cpu", "memory_bytes": 64 * MIB}]})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": {"preset": "tiny-2l", "seed": 1}, "sla": {"ttft_ms": 1, "tpot_ms": 1},
     "home_devices": ["h0"]},
    {"name": "b", "model": {"preset": "tiny-2l", "seed": 2}, "sla": {"ttft_ms": 1, "tpot_ms": 1},
     "home_devices": ["g0"]}]}, cluster=CLUSTER)


async def _started_agent(redis, prefix: str, device: str, tenant: str) -> tuple[GMGStore, LeaseAgent]:
    """The GMG registered and a started lease agent of ``tenant`` on ``device`` (its model built, 16 KV blocks)."""
    store = GMGStore(redis, prefix)
    await store.register_cluster(CLUSTER, TENANTS)
    model, tok = build_model(TENANTS.get(tenant).model)
    agent = LeaseAgent(prefix=prefix, redis=redis, gmg=store, cluster=CLUSTER, device=CLUSTER.device(device),
                       tenant=TENANTS.get(tenant), tenants=TENANTS, engine=Engine(model, tok, kv_blocks=16),
                       options=LeaseOptions())
    await agent.start()
    return store, agent


async def test_lru_eviction_when_the_home_tenant_needs_memory(redis, prefix):
    home_model, _ = build_model(TENANTS.get("a").model)
    store, agent = await _started_agent(redis, prefix, "g0", "b")
    try:
        segs = ["mlp[0]", "mlp[1]"]
        nbytes = {s: home_model.segment_weight_bytes(s) for s in segs}
        ls = LeaseStore(store)
        assert isinstance(await ls.stage("g0", "a", nbytes), int)
        for s in segs:  # as the staging thread would have done
            agent.weights.put("a", home_model.cfg, s, home_model.segment_state_dict(s))
        agent.weights.get("a", "mlp[0]")  # mlp[1] is now the least recently used
        now = time.time()
        assert isinstance(await ls.commit(Lease("L", "a", "g0", ("mlp[0]",), now, now + 60, MIB, home="h0")), int)
        await agent.on_message(LeaseGranted(msg_id="m", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0", segments=["mlp[0]"], start_ts=now, end_ts=now + 60))
        assert await agent.evict_if_needed() == []  # plenty of memory: the cache stays
        # the device's own tenant takes memory until less than the low-water mark (10 %) is free
        row = await store.device("g0")
        free = int(row["limit"]) - int(row["reserved"])
        assert isinstance(await store.reserve([Reservation("g0", "kv:b:big", "kv", "b", free - 4 * MIB)]), int)
        assert await agent.evict_if_needed() == [("a", "mlp[1]")]  # LRU first; mlp[0] is pinned by lease L
        assert not agent.weights.has("a", "mlp[1]") and agent.weights.has("a", "mlp[0]")
        assert await redis.hget(store.keys.resident("g0"), "a|mlp[1]") is None
        assert "weights:a:mlp[1]" not in await store.reservations("g0")
        assert await agent.evict_if_needed() == []  # still short, but the rest is pinned
        await ls.close("L", "revoked", "test")
        await agent.on_message(LeaseRevoked(msg_id="r", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0"))
        assert await agent.evict_if_needed() == [("a", "mlp[0]")]
        assert agent.weights.nbytes == 0 and agent.health_fields()["staged_segments"] == 0
    finally:
        await agent.close()


async def test_a_re_sent_grant_extends_the_drivers_link(redis, prefix):
    import asyncio

    _, agent = await _started_agent(redis, prefix, "h0", "a")
    try:
        now = time.time()
        grant = LeaseGranted(msg_id="m", lease_id="L", tenant="a", home_device="h0", guest_device="g0",
                             segments=["mlp[0]"], start_ts=now, end_ts=now + 0.5)
        await agent.on_message(grant)
        link = agent.links["L"]
        await agent.on_message(LeaseGranted(msg_id="m2", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0", segments=["mlp[0]"], start_ts=now, end_ts=now + 60))
        assert agent.links["L"] is link and link.lease.end_ts == now + 60  # the same link, a later end
        await asyncio.sleep(1.0)  # past the first window: the link is still kept (retrying: g0 has no server)
        assert link.state != "ended"
        await agent.on_message(LeaseRevoked(msg_id="r", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0"))
        assert link.state == "ended"
        await agent.on_message(grant)  # an ended lease is not revived by a late re-send
        assert agent.links["L"] is link and link.state == "ended"
    finally:
        await agent.close()
