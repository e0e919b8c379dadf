"""The GMG state service against a real redis-server: worker events become GMG state, every change bumps the epoch
and appears on the change stream, stale devices go down, and a follower sees the same GMG."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.config import Settings, parse_cluster, parse_tenants
from shared.gmg.follower import GMGFollower, read_mirror
from shared.messages import (DeviceDown, RequestFinished, RequestStarted, SegmentStat, StepReport, WorkerHeartbeat,
                             events_stream)
from shared.streams import StreamProducer
from services.gmg.service import GMGService
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)

pytestmark = pytest.mark.integration

CLUSTER = parse_cluster({"devices": [{"id": "d0", "backend": "cpu", "memory_bytes": 10_000_000},
                                     {"id": "d1", "backend": "cpu", "memory_bytes": 10_000_000}]})
TENANTS = parse_tenants({"tenants": [{"name": "a", "model": "tiny", "sla": {"ttft_ms": 100, "tpot_ms": 10},
                                      "home_devices": ["d0"]}]})


def _hb(dev: str, ts: float, **kw) -> WorkerHeartbeat:
    return WorkerHeartbeat(msg_id=f"hb-{dev}-{ts}", device=dev, worker_id=kw.pop("worker_id", "w1"), backend="cpu",
                           home_tenant="a", ts=ts, **kw)


async def _service(redis_url: str, prefix: str) -> GMGService:
    svc = GMGService(Settings(redis_url=redis_url, prefix=prefix), CLUSTER, TENANTS)
    svc.consumer.block_ms = 100
    await svc.start()
    return svc


async def _drain(svc: GMGService, n: int) -> None:
    stop = asyncio.Event()
    await asyncio.wait_for(svc.consumer.run(stop, max_messages=svc.consumer.handled + n), timeout=10)


async def test_events_become_gmg_state(redis_url, redis, prefix):
    svc = await _service(redis_url, prefix)
    prod, ev, now = StreamProducer(redis), events_stream(prefix), time.time()
    e0 = await svc.store.epoch()
    await prod.add(ev, _hb("d0", now, weight_bytes=1000, kv_used_bytes=234, kv_total_bytes=5000, running=2,
                           queued=1, busy_ratio=0.5))
    await prod.add(ev, _hb("d0", now - 1))  # out of order: ignored
    await prod.add(ev, StepReport(msg_id="s1", device="d0", tenant="a", window_start_ts=now - 0.2,
                                  window_end_ts=now, steps=4, busy_ms=150.0,
                                  segments=[SegmentStat("mlp[0]", 8, 4, 2.0)],
                                  busy_intervals=[(now - 0.2, now - 0.1), (now - 0.08, now - 0.01)]))
    await prod.add(ev, RequestStarted(msg_id="r1", request_id="q1", tenant="a", device="d0", ts=now))
    await prod.add(ev, RequestStarted(msg_id="r1", request_id="q1", tenant="a", device="d0", ts=now))  # duplicate
    await prod.add(ev, RequestFinished(msg_id="f1", request_id="q1", tenant="a", device="d0", outcome="stop",
                                       prompt_tokens=3, completion_tokens=4, kv_blocks=1, ts=now + 0.5))
    await _drain(svc, 6)
    dev = await svc.store.device("d0")
    assert dev["state"] == "ready" and dev["used"] == "1234" and dev["kv_used"] == "234"
    assert dev["kv_total"] == "5000" and dev["running"] == "2" and dev["queued"] == "1"
    assert float(dev["busy_ratio"]) == 0.5 and dev["worker_id"] == "w1" and abs(float(dev["heartbeat_ts"]) - now) < 1e-5
    ex = {k.decode(): v.decode() for k, v in (await redis.hgetall(svc.store.keys.exec_state("d0"))).items()}
    assert ex["steps_total"] == "4" and float(ex["busy_ms_total"]) == 150.0
    assert ex["started_total"] == "1" and ex["finished_total"] == "1"
    assert await redis.zcard(svc.store.keys.busy("d0")) == 2
    assert await redis.hlen(svc.store.keys.requests("d0")) == 0
    # heartbeat, step, started, finished: 4 changes, one epoch each, one change entry each
    assert await svc.store.epoch() == e0 + 4
    entries = await redis.xrange(svc.store.keys.changes)
    epochs = [int(f[b"epoch"]) for _, f in entries]
    assert epochs == sorted(epochs) and epochs[-4:] == [e0 + 1, e0 + 2, e0 + 3, e0 + 4]
    assert [f[b"op"] for _, f in entries[-4:]] == [b"heartbeat", b"step", b"request_started", b"request_finished"]
    await svc.blocking.aclose()


async def test_stale_heartbeat_and_device_down(redis_url, redis, prefix):
    svc = await _service(redis_url, prefix)
    prod, ev, now = StreamProducer(redis), events_stream(prefix), time.time()
    await prod.add(ev, _hb("d0", now))
    await prod.add(ev, _hb("d1", now))
    await _drain(svc, 2)
    assert await svc.sweep_once(time.time() + 1.0) == 0  # fresh: stays up
    svc.core.devices["d0"].seen_ts -= 3.5  # d0's newest heartbeat arrived 3.5 s ago (on the GMG's clock)
    assert await svc.sweep_once() == 1
    assert (await svc.store.device("d0"))["state"] == "down"
    assert (await svc.store.device("d0"))["down_reason"] == "heartbeat_timeout"
    assert (await svc.store.device("d1"))["state"] == "ready"
    await prod.add(ev, DeviceDown(msg_id="x", device="d1", worker_id="w1", reason="worker_exit", ts=now + 4))
    await _drain(svc, 1)
    assert (await svc.store.device("d1"))["state"] == "down"
    await prod.add(ev, _hb("d0", now + 5, worker_id="w2"))  # a restarted worker brings d0 back
    await _drain(svc, 1)
    assert (await svc.store.device("d0"))["state"] == "ready"
    await svc.blocking.aclose()


async def test_restart_keeps_state_and_follower_matches(redis_url, redis, prefix):
    svc = await _service(redis_url, prefix)
    follower = GMGFollower(redis, prefix)
    await follower.load()
    prod, ev, now = StreamProducer(redis), events_stream(prefix), time.time()
    for i in range(5):
        await prod.add(ev, _hb("d0", now + i * 0.1, running=i))
    await _drain(svc, 5)
    await svc.blocking.aclose()
    svc2 = await _service(redis_url, prefix)  # a restarted service re-registers and keeps live fields
    assert (await svc2.store.device("d0"))["running"] == "4"
    await prod.add(ev, _hb("d0", now))  # older than what the first instance applied: still ignored
    await _drain(svc2, 1)
    assert (await svc2.store.device("d0"))["running"] == "4"
    await follower.catch_up()
    mirror, epoch, _ = await read_mirror(redis, svc2.store.keys)
    assert follower.epoch == epoch and follower.mirror == mirror
    snap = follower.snapshot
    assert snap.devices["d0"].running == 4 and snap.tenants["a"].home_devices == ("d0",)
    assert snap.holders("a", "mlp[0]") == ["d0"] and "a" in snap.graphs
    await svc2.blocking.aclose()


async def test_gmg_reregisters_after_redis_loses_its_state(redis_url, redis, prefix):
    svc = await _service(redis_url, prefix)
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{gmg}}*")]
    await redis.delete(*keys)  # what a restart without persistence looks like to the service
    assert await svc.sweep_once() >= 1
    dev = await svc.store.device("d0")
    assert dev["limit"] and dev["state"] == "down" and dev["reserved"] == "0"
    assert await redis.exists(svc.store.keys.model_graph("a"))
    await svc.blocking.aclose()
