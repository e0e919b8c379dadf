"""GMG start-up reconciliation and stream expiry against a real redis-server: a GMG started with a changed config
leaves only what the config describes (memory accounting consistent, followers replay it), refuses to remove what a
running old-config worker uses, and deletes the streams of dead gateways and removed devices."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import yaml

from services.gmg.reconcile import ReconcileOptions, ReconcileRefused
from services.gmg.service import GMGService
from shared.config import Settings, parse_cluster, parse_tenants
from shared.gmg import GMGStore, Lease, LeaseStore, Reservation
from shared.gmg.follower import GMGFollower, read_mirror
from shared.gmg.store import segment_bytes
from shared.messages import sim_forecast_key, sim_rates_key, tokens_stream, worker_stream
from shared.requests_state import req_key, tenant_stats_key
from shared.service import health_key

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cluster(*ids):
    return parse_cluster({"devices": [{"id": d, "backend": "cpu", "memory_bytes": 50_000_000} for d in ids]},
                         "cluster.yaml")


def tenants(*specs):
    return parse_tenants({"tenants": [{"name": n, "model": m, "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": h}
                                      for n, m, h in specs]}, "tenants.yaml")


C_OLD, T_OLD = cluster("d0", "d1", "d2"), tenants(("a", "tiny-2l", ["d0"]), ("b", "tiny-2l", ["d1"]),
                                                  ("c", "tiny-2l", ["d2"]))
C_NEW, T_NEW = cluster("d0", "d1"), tenants(("a", {"preset": "tiny-2l", "seed": 5}, ["d0"]),
                                            ("n", "tiny", ["d1"]))  # a's model changed, b/c/d2 removed, n added


def s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def gmg(redis_url, prefix, c, t, **opts) -> GMGService:
    svc = GMGService(Settings(redis_url=redis_url, prefix=prefix), c, t, options=ReconcileOptions(**opts))
    await svc.start()
    return svc


async def old_mesh_state(redis, prefix, svc: GMGService) -> None:
    """What the old mesh leaves: home weights, a staged copy of a's mlp[0] on d1 with a lease, KV of a running and
    an ended request, a GMG running record, scheduler stats, simulator fields and forecasts."""
    store = svc.store
    for t in T_OLD.tenants:
        w = sum(segment_bytes(t.model.config).values())
        assert isinstance(await store.reserve([Reservation(t.home_devices[0], f"weights:{t.name}:home", "weights",
                                                           t.name, w)]), int)
    mlp = segment_bytes(T_OLD.get("a").model.config)["mlp[0]"]
    lease = Lease("L1", "a", "d1", ("mlp[0]",), time.time(), time.time() + 3600, 4096, home="d0")
    assert isinstance(await LeaseStore(store).commit(lease, stage={"mlp[0]": mlp}), int)
    assert isinstance(await store.reserve([Reservation("d0", "kv:r-run", "kv", "a", 1000),
                                           Reservation("d1", "kv:r-b", "kv", "b", 1000),
                                           Reservation("d0", "kv:r-done", "kv", "a", 1000)]), int)
    await redis.hset(req_key(prefix, "r-run"), mapping={"state": "running", "tenant": "a"})
    await redis.hset(req_key(prefix, "r-done"), mapping={"state": "done", "tenant": "a"})
    await redis.hset(store.keys.requests("d2"), mapping={"r-c": "c|running|1.0"})
    for t in ("a", "b", "c"):
        await redis.hset(tenant_stats_key(prefix, t), mapping={"queued": 0, "ts": time.time()})
    await redis.hset(sim_rates_key(prefix), mapping={"ts": 1, "a": 1.0, "b": 2.0, "b:mean_input": 3})
    await redis.hset(sim_forecast_key(prefix, "d2"), mapping={"ts": 1})


async def reservations(redis, store, d) -> dict[str, str]:
    return {s(k): s(v) for k, v in (await redis.hgetall(store.keys.reservations(d))).items()}


async def test_changed_config_leaves_only_what_it_describes(redis_url, redis, prefix):
    old = await gmg(redis_url, prefix, C_OLD, T_OLD)
    await old_mesh_state(redis, prefix, old)
    await old.blocking.aclose()
    follower = GMGFollower(redis, prefix)
    await follower.load()

    new = await gmg(redis_url, prefix, C_NEW, T_NEW)
    k = new.store.keys
    assert {s(x) for x in await redis.smembers(k.devices)} == {"d0", "d1"}
    assert {s(x) for x in await redis.smembers(k.tenants)} == {"a", "n"}
    assert not [x async for x in redis.scan_iter(match=f"{prefix}{{gmg}}:*d2")]  # every key of d2
    assert not await redis.exists(k.tenant("b"), k.model_graph("b"), k.tenant("c"), k.lease("L1"))
    r0, r1 = await reservations(redis, new.store, "d0"), await reservations(redis, new.store, "d1")
    assert set(r0) == {"weights:a:home", "kv:r-run"}  # the ended request's KV went; the home stays (worker resizes)
    assert r1 == {}  # b's home and KV, a's staged copy (model changed) and the lease buffer all released
    for d, r in (("d0", r0), ("d1", r1)):  # the accounting still adds up
        dev = await new.store.device(d)
        assert int(dev["reserved"]) == sum(int(v.split("|")[2]) for v in r.values())
    res1 = {s(f) for f in await redis.hkeys(k.resident("d1"))}
    assert res1 == {f"n|{seg}" for seg in segment_bytes(T_NEW.get("n").model.config)}
    assert not await redis.hgetall(k.pins("d1")) and not await redis.zcard(k.leases("d1"))
    assert {s(x) for x in await redis.hkeys(sim_rates_key(prefix))} == {"ts", "a"}
    assert not await redis.exists(tenant_stats_key(prefix, "b"), tenant_stats_key(prefix, "c"),
                                  sim_forecast_key(prefix, "d2"))
    assert await redis.exists(tenant_stats_key(prefix, "a"))
    ops = [s(f[b"op"]) for _, f in await redis.xrange(k.changes)]
    assert "reconcile" in ops and "lease_revoked" in ops
    await follower.catch_up()  # followers replay the removal like any other change
    mirror, epoch, _ = await read_mirror(redis, k)
    assert follower.epoch == epoch and follower.mirror == mirror
    assert set(follower.snapshot.tenants) == {"a", "n"} and set(follower.snapshot.devices) == {"d0", "d1"}
    await new.blocking.aclose()
    again = await gmg(redis_url, prefix, C_NEW, T_NEW)  # a second start with the same config removes nothing
    assert (await again.housekeeper.reconcile()).empty()
    await again.blocking.aclose()


async def test_a_running_old_config_worker_blocks_removal(redis_url, redis, prefix):
    old = await gmg(redis_url, prefix, C_OLD, T_OLD)
    await old_mesh_state(redis, prefix, old)
    await old.blocking.aclose()
    hk = health_key(prefix, "worker", "d1")
    await redis.hset(hk, mapping={"pid": 4242, "tenant": "b", "ready": 1})  # b's worker still runs on d1
    t0 = time.monotonic()
    with pytest.raises(ReconcileRefused) as ei:
        await gmg(redis_url, prefix, C_NEW, T_NEW, wait_s=0.6)
    assert time.monotonic() - t0 >= 0.6
    assert len(ei.value.conflicts) == 1 and "device 'd1'" in str(ei.value) and "pid 4242" in str(ei.value)
    assert await redis.exists(old.store.keys.tenant("b"))  # nothing was removed
    await redis.expire(hk, 1)  # the worker stops (a killed one's key lapses with its TTL): the GMG goes ahead
    new = await gmg(redis_url, prefix, C_NEW, T_NEW, wait_s=5)
    assert not await redis.exists(new.store.keys.tenant("b"))
    await new.blocking.aclose()


def test_gmg_process_refuses_with_a_clear_message(redis_url, tmp_path):
    prefix = f"p{os.getpid()}x:"
    import redis as syncredis

    r = syncredis.Redis.from_url(redis_url)
    r.hset(health_key(prefix, "worker", "gone"), mapping={"pid": 77, "tenant": "z", "ready": 1})
    r.sadd(f"{prefix}{{gmg}}:devices", "gone")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"devices": [{"id": "d0", "backend": "cpu", "memory_gb": 0.1}]}))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"tenants": [{"name": "a", "model": "tiny", "home_devices": ["d0"],
                                                                  "sla": {"ttft_ms": 1, "tpot_ms": 1}}]}))
    env = dict(os.environ, REDIS_URL=redis_url, SLICESCHED_PREFIX=prefix, SLICESCHED_CLUSTER=str(tmp_path / "c.yaml"),
               SLICESCHED_TENANTS=str(tmp_path / "t.yaml"), SLICESCHED_RECONCILE_WAIT_S="0.3")
    try:
        p = subprocess.run([sys.executable, "-m", "services.gmg"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
    finally:
        for key in r.scan_iter(match=f"{prefix}*"):
            r.delete(key)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("gmg: refusing to start: device 'gone' is not in") and "pid 77" in last, last


async def test_streams_of_dead_gateways_and_removed_devices_expire(redis_url, redis, prefix):
    svc = await gmg(redis_url, prefix, C_NEW, T_NEW, stream_expiry_s=0.5)
    for gw in ("gw-dead", "gw-live"):
        await redis.xadd(tokens_stream(prefix, gw), {"m": b"x"})
    await redis.hset(health_key(prefix, "gateway", "gw-live"), mapping={"pid": 1})
    for d in ("d0", "d9"):  # d0 is configured (its assignments must survive a worker restart), d9 is not
        await redis.xgroup_create(worker_stream(prefix, d), "worker", id="0", mkstream=True)
    await redis.xadd(f"{prefix}requests", {"m": b"x"})
    # d9's stream never had an entry; the dead gateway's got one just now, so it waits for the expiry
    assert await svc.housekeeper.expire_streams() == [worker_stream(prefix, "d9")]
    await asyncio.sleep(0.6)
    assert await svc.housekeeper.expire_streams() == [tokens_stream(prefix, "gw-dead")]
    gone = [worker_stream(prefix, "d9"), tokens_stream(prefix, "gw-dead")]
    left = {s(x) async for x in redis.scan_iter(match=f"{prefix}*", _type="STREAM")}
    assert {tokens_stream(prefix, "gw-live"), worker_stream(prefix, "d0"), f"{prefix}requests"} <= left
    assert not left & set(gone)
    await svc.blocking.aclose()
