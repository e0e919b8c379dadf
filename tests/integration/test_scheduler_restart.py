"""The scheduler's restart against a real Redis: requests it had placed for a tenant or on a device the config no
longer has end with a clear error to their gateway; a newer worker id read from a heartbeat is not replaced by the
GMG's older row (a request placed then would be failed as 'worker restarted'); tenant stats say how many home
devices have a live worker (what the gateway's /ready reads)."""
from __future__ import annotations

import time

import pytest

from services.scheduler.policy import load_live_policy
from services.scheduler.service import SchedulerService
from shared.codec import decode
from shared.config import Settings, parse_cluster, parse_tenants
from shared.gmg import GMGStore, Reservation
from shared.messages import CancelAssigned, RequestError, TokensMsg, WorkerMsg, tokens_stream, worker_stream
from shared.redis_util import close_quietly
from shared.requests_state import assigned_key, req_key, tenant_stats_key
from shared.streams import entry_payload

pytestmark = pytest.mark.integration


def cluster(*ids):
    return parse_cluster({"devices": [{"id": d, "backend": "emulated", "memory_gb": 0.25} for d in ids]})


def tenants(*specs):
    return parse_tenants({"tenants": [{"name": n, "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10},
                                       "home_devices": [d]} for n, d in specs]})


C_OLD, T_OLD = cluster("d0", "d1", "d2"), tenants(("a", "d0"), ("b", "d1"), ("c", "d2"))
C_NEW, T_NEW = cluster("d0", "d1"), tenants(("a", "d0"), ("n", "d1"))


def scheduler(redis_url, prefix) -> SchedulerService:
    return SchedulerService(Settings(redis_url=redis_url, prefix=prefix), C_NEW, T_NEW,
                            load_live_policy("container"))


def s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def test_restart_ends_requests_of_removed_tenants_and_devices(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(C_OLD, T_OLD)
    for rid, tenant, dev in (("r-a", "a", "d0"), ("r-b", "b", "d1"), ("r-c", "c", "d2"), ("r-done", "a", "d0")):
        await redis.hset(req_key(prefix, rid), mapping={"tenant": tenant, "gateway": "gw", "device": dev,
                                                        "state": "done" if rid == "r-done" else "running",
                                                        "worker_id": f"w-{dev}"})
        await redis.sadd(assigned_key(prefix, dev), rid)
        assert isinstance(await store.reserve([Reservation(dev, f"kv:{rid}", "kv", tenant, 1000)]), int)
    svc = scheduler(redis_url, prefix)
    try:
        await svc._restore()
        assert set(svc.assigned) == {"r-a"} and svc.assigned["r-a"][0] == "d0"
        errors = {m.request_id: m for m in (decode(entry_payload(f), TokensMsg)
                                            for _, f in await redis.xrange(tokens_stream(prefix, "gw")))}
        assert set(errors) == {"r-b", "r-c"} and all(isinstance(m, RequestError) for m in errors.values())
        b, c = errors["r-b"], errors["r-c"]
        assert (b.status, b.code, b.retryable) == (404, "tenant_removed", False) and "'b'" in b.message
        assert (c.status, c.code, c.retryable) == (503, "device_removed", True) and "'d2'" in c.message
        for rid in ("r-b", "r-c"):
            assert s(await redis.hget(req_key(prefix, rid), "state")) == "failed"
        assert "kv:r-b" not in await store.reservations("d1")  # released
        assert {s(x) for x in await redis.smembers(assigned_key(prefix, "d1"))} == set()
        assert not await redis.exists(assigned_key(prefix, "d2"))
        assert {s(x) for x in await redis.smembers(assigned_key(prefix, "d0"))} == {"r-a"}  # r-done cleaned
        cancels = [decode(entry_payload(f), WorkerMsg) for _, f in await redis.xrange(worker_stream(prefix, "d1"))]
        assert [(type(m), m.request_id) for m in cancels] == [(CancelAssigned, "r-b")]
        assert not await redis.exists(worker_stream(prefix, "d2"))  # nothing sent to a removed device
    finally:
        await close_quietly(svc.redis, *svc._blocking)


async def test_a_newer_worker_id_from_a_heartbeat_wins_over_the_gmg_row(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    await store.register_cluster(C_NEW, T_NEW)
    now = time.time()
    await store.update_device("d0", {"state": "ready", "heartbeat_ts": f"{now - 0.2:.6f}", "worker_id": "w-old"})
    svc = scheduler(redis_url, prefix)
    try:
        await svc._refresh_devices()
        v = svc.devices["d0"]
        assert v.up and v.worker_id == "w-old"
        svc._hb_seen["d0"], v.worker_id = now, "w-new"  # the new worker's heartbeat, read on the events stream
        await svc._refresh_devices()  # the GMG has not applied it yet: its row is older
        assert svc.devices["d0"].worker_id == "w-new"
        await store.update_device("d0", {"heartbeat_ts": f"{now + 0.1:.6f}", "worker_id": "w-newer"})
        await svc._refresh_devices()
        assert svc.devices["d0"].worker_id == "w-newer"
        await svc._publish_tenant_stats()
        a = {s(k): s(x) for k, x in (await redis.hgetall(tenant_stats_key(prefix, "a"))).items()}
        n = {s(k): s(x) for k, x in (await redis.hgetall(tenant_stats_key(prefix, "n"))).items()}
        assert (a["homes_up"], a["homes"]) == ("1", "1") and (n["homes_up"], n["homes"]) == ("0", "1")  # d1: down
    finally:
        await close_quietly(svc.redis, *svc._blocking)


async def test_a_finished_request_counts_once_in_its_tenants_attainment_from_its_arrival(redis_url, redis, prefix):
    """What ``slice``'s guard reads (``shared/policies/attainment.py``): a request that finished 50 ms after it started
    on its worker, but 5 s after it reached the gateway, missed its 100-ms TTFT target; a redelivered finish of the
    same request does not count again."""
    from types import SimpleNamespace

    from shared.messages import InferenceRequest, RequestFinished
    await GMGStore(redis, prefix).register_cluster(C_NEW, T_NEW)
    svc = scheduler(redis_url, prefix)
    now = time.time()
    try:
        svc.assigned["r1"] = ("d0", InferenceRequest(msg_id="m1", request_id="r1", tenant="a", gateway="gw",
                                                     prompt_ids=[1] * 10, max_tokens=5, arrival_ts=now - 5.0), "w")
        fin = RequestFinished(msg_id="f1", request_id="r1", tenant="a", device="d0", outcome="stop", prompt_tokens=10,
                              completion_tokens=5, kv_blocks=1, ts=now, ttft_ms=50.0, e2e_ms=60.0)
        for _ in range(2):
            await svc._on_event(SimpleNamespace(msg=fin))
        a = svc.snapshots.attainment["a"]
        assert (a.requests, a.violations) == (1.0, 1.0)
        assert "r1" not in svc.assigned
        assert svc.decision_snapshot().tenants["a"].violation_rate == 1.0
    finally:
        await close_quietly(svc.redis, *svc._blocking)
