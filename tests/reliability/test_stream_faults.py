"""Matrix rows 9-13: cancellation storm, a burst beyond the connection pool, a backlog held while the scheduler is
stopped, poison entries on the requests and worker streams, and duplicated requests. Rows 11-13 write straight to
the streams as a stand-in gateway (their results land on a tokens stream the tap follows)."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid

import aiohttp
import pytest

from reliability.load import Driver
from reliability.results import RowResult, summarize
from reliability.rig import DEVICES, KEYS, Rig
from reliability.scenario import (SEEDS, fake_request, finish, n_requests, poison_payloads, seed_base, xadd_poison,
                                  xadd_requests)
from reliability.tap import Tap
from shared.messages import GROUP_SCHEDULER, dead_stream, requests_stream, worker_stream
from shared.redis_util import command_client
from shared.streams import safe_trim

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

PROTOCOL_ERRORS = ("InvalidResponse", "ProtocolError", "Protocol error", "unhandled_exception", "invalid reply",
                   "stream_pending_entry_deleted", "Too many connections")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig.start(tmp_path_factory.mktemp("rel-streams"))
    try:
        yield r
    finally:
        r.stop()


async def _tapped(tap: Tap):
    stop = asyncio.Event()
    task = asyncio.create_task(tap.run(stop))
    await asyncio.sleep(0.3)
    return stop, task


async def _wait_terminals(tap: Tap, rids: list[str], timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if all(tap.terminals.get(r) for r in rids):
            break
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


def _direct_figures(res: RowResult, tap: Tap, rids: list[str]) -> None:
    """accepted/lost/duplicated for requests written straight to the requests stream."""
    res.requests = res.accepted = len(rids)
    res.lost = sum(1 for r in rids if not tap.terminals.get(r))
    res.duplicated = sum(1 for r in rids if len(tap.terminals.get(r, [])) > 1)
    codes: dict[str, int] = {}
    for r in rids:
        for kind, code, *_ in tap.terminals.get(r, [])[:1]:
            key = "ok" if kind == "finish" else code
            codes[key] = codes.get(key, 0) + 1
    res.extra["outcomes"] = dict(sorted(codes.items()))
    res.errors = {k: v for k, v in codes.items() if k != "ok"}
    res.extra["reexecuted"] = sum(1 for r in rids if tap.started.get(r, 0) > 1)


@pytest.mark.parametrize("seed", SEEDS)
async def test_row9_cancellation_storm(rig, seed):
    res = RowResult("9", "cancellation storm (clients disconnect while handlers await Redis)", seed=seed)
    since = time.time()
    rng = random.Random(seed)
    driver = Driver(rig.mesh.gateway, seed_base=seed_base("9", seed), max_tokens=24)
    tap = Tap(rig.redis_url, rig.prefix)
    stop, task = await _tapped(tap)
    t0 = time.monotonic()
    gate = asyncio.Semaphore(48)
    async with driver.session() as s:
        async def one():
            async with gate:
                return await driver.call(s, cancel_after_s=rng.uniform(0.005, 0.4))
        calls = await asyncio.gather(*(one() for _ in range(n_requests(1000))))
    storm_end = time.monotonic()
    free_s = await asyncio.to_thread(rig.wait_idle, 90)
    leaked = await asyncio.to_thread(_wait_no_leaks, rig, 10)
    # no reply mix-ups: identical greedy prompts give identical texts, and every body id is its own request id
    mixups = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def check(k: int, tenant: str):
            body = {"model": tenant, "prompt": f"mixup {k}", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            async with s.post(f"{rig.mesh.gateway}/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
                d = await r.json()
                return k, tenant, r.status, r.headers.get("X-Request-Id"), d
        checks = []
        for _ in range(3):  # paced, so the gateway's admission does not turn the check itself away
            checks += await asyncio.gather(*(check(k, t) for k in range(4) for t in KEYS))
    texts: dict[tuple, set] = {}
    for k, t, status, rid, d in checks:
        if status != 200:
            res.extra.setdefault("verification_status", []).append(status)
            continue
        if d.get("id", "").removeprefix("cmpl-") != rid:
            mixups += 1
            continue
        texts.setdefault((k, t), set()).add(d["choices"][0]["text"])
    mixups += sum(len(v) - 1 for v in texts.values())
    verified = sum(1 for c in checks if c[2] == 200)
    stop.set()
    await task
    summarize(res, calls, tap)
    res.lost = sum(1 for c in calls if c.began and c.outcome not in ("ok", "error", "cancelled"))
    res.extra.update({"cancelled_by_client": sum(1 for c in calls if c.outcome == "cancelled"),
                      "mixups": mixups, "verification_requests": len(checks), "verification_ok": verified,
                      "protocol_errors_in_logs": rig.log_events(*PROTOCOL_ERRORS, since=since),
                      "time_to_free_slots_s": round(free_s, 2), "storm_s": round(storm_end - t0, 1)})
    res.extra["leaked_slots"] = leaked
    res.extra["lost_ids"], res.extra["lost_by_outcome"] = [], {}
    res.duration_s = round(time.monotonic() - t0, 1)
    res.note("also row 15 end to end: after the storm every KV reservation but the weights is released")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert mixups == 0 and leaked == 0 and verified >= len(checks) // 2
    assert not any(res.extra["protocol_errors_in_logs"].values()), res.extra["protocol_errors_in_logs"]


def _wait_no_leaks(rig: Rig, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:  # device hashes follow heartbeats (every 0.5 s)
        leaked = _leaked_slots(rig)
        if leaked == 0 or time.monotonic() > deadline:
            return leaked
        time.sleep(0.25)


def _leaked_slots(rig: Rig) -> int:
    """KV reservations and running requests left on the devices once the mesh is idle."""
    r = rig.r()
    leaked = 0
    for d in DEVICES:
        rsv = r.hkeys(f"{rig.prefix}{{gmg}}:reservations:{d}")
        leaked += sum(1 for k in rsv if k.startswith(b"kv:"))
        leaked += int(r.hget(f"{rig.prefix}{{gmg}}:device:{d}", "running") or 0)
    return leaked


@pytest.mark.parametrize("seed", SEEDS)
async def test_row10_burst_beyond_connection_pool(rig, seed):
    res = RowResult("10", "burst of 10x the gateway's Redis pool (2,560 concurrent requests)", seed=seed)
    since = time.time()
    gw_pid = rig.pid("gateway", _gateway_name(rig))
    driver = Driver(rig.mesh.gateway, seed_base=seed_base("10", seed), max_tokens=2, stream=False,
                    deadline_s=120)
    tap = Tap(rig.redis_url, rig.prefix)
    stop, task = await _tapped(tap)
    t0 = time.monotonic()
    async with driver.session() as s:
        calls = await asyncio.gather(*(driver.call(s) for _ in range(2560)))
    await asyncio.sleep(1.0)
    stop.set()
    await task
    summarize(res, calls, tap)
    ok = sorted(c.e2e for c in calls if c.outcome == "ok")
    res.extra.update({"p99_ok_s": round(ok[int(0.99 * (len(ok) - 1))], 3) if ok else None,
                      "error_rate": round(1 - len(ok) / len(calls), 3),
                      "log_events": rig.log_events(*PROTOCOL_ERRORS, since=since),
                      "gateway_restarted": rig.pid("gateway", _gateway_name(rig)) != gw_pid})
    res.duration_s = round(time.monotonic() - t0, 1)
    res.note("the gateway's pool holds 256 connections; tenant bounds answer 429/503 with Retry-After")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert res.extra["log_events"]["Too many connections"] == 0 and not res.extra["gateway_restarted"]
    assert all(c.status in (200, 429, 503) for c in calls), res.extra["http_errors"]


def _gateway_name(rig: Rig) -> str:
    r = rig.r()
    for k in r.scan_iter(match=f"{rig.prefix}health:gateway:*"):
        return k.decode().rsplit(":", 1)[1]
    return ""


@pytest.mark.parametrize("seed", SEEDS)
async def test_row11_backlog_with_stopped_scheduler(rig, seed):
    """3,000 requests pile up unread while the scheduler is stopped and MINID trims run: none is trimmed."""
    res = RowResult("11", "backlog held while the scheduler is stopped (trims keep unread and pending entries)",
                    seed=seed)
    gw = f"relgw-11-{uuid.uuid4().hex[:6]}"
    tap = Tap(rig.redis_url, rig.prefix)
    stop, task = await _tapped(tap)
    t0 = time.monotonic()
    r = rig.r()
    pid = rig.signal("scheduler", "scheduler-0", signal.SIGSTOP)
    try:
        reqs = [fake_request(t, gw, max_tokens=2) for _ in range(1500) for t in KEYS]
        await asyncio.to_thread(xadd_requests, r, rig.prefix, reqs)
        length_before = r.xlen(requests_stream(rig.prefix))
        ar = command_client(rig.redis_url)
        for _ in range(3):  # what every reclaim loop does every 30 s
            await safe_trim(ar, requests_stream(rig.prefix))
        await ar.aclose()
        length_after_trim = r.xlen(requests_stream(rig.prefix))
    finally:
        os.kill(pid, signal.SIGCONT)
    waited = await _wait_terminals(tap, [q.request_id for q in reqs], 300)
    claim = r.xautoclaim(requests_stream(rig.prefix), GROUP_SCHEDULER, "scheduler-0", 0, "0-0", count=10_000,
                         justid=True)
    stop.set()
    await task
    _direct_figures(res, tap, [q.request_id for q in reqs])
    res.extra.update({"backlog": len(reqs), "stream_len_before_trim": length_before,
                      "stream_len_after_trim": length_after_trim, "drain_s": round(waited, 1),
                      "xautoclaim_deleted_ids": len(claim[2]) if len(claim) > 2 else 0,
                      "pending_entry_deleted_logs": rig.log_events("stream_pending_entry_deleted")[
                          "stream_pending_entry_deleted"]})
    res.recovery_s = round(waited, 1)
    res.duration_s = round(time.monotonic() - t0, 1)
    res.note("requests and worker streams carry no MAXLEN (MINID trims below the oldest pending / last delivered "
             "id); events and tokens streams cap at 200k; queues past a tenant's bound end with 429")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert length_after_trim >= len(reqs) and res.extra["xautoclaim_deleted_ids"] == 0  # unread entries kept


@pytest.mark.parametrize("seed", SEEDS)
async def test_row12_poison_entries(rig, seed):
    res = RowResult("12", "poison entries on the requests and worker streams", seed=seed)
    gw = f"relgw-12-{uuid.uuid4().hex[:6]}"
    r = rig.r()
    pids = {n: rig.pid(s, n) for s, n in (("scheduler", "scheduler-0"), ("worker", "cpu1"))}
    dead_before = r.xlen(dead_stream(rig.prefix))
    payloads = poison_payloads(gw)
    injected = sum(len(v) for v in payloads.values())
    tap = Tap(rig.redis_url, rig.prefix)
    driver = Driver(rig.mesh.gateway, seed_base=seed_base("12", seed), max_tokens=6)
    t0 = time.monotonic()

    async def scenario():
        load = asyncio.create_task(driver.open_loop(n_requests(300), 15, random.Random(seed)))
        await asyncio.sleep(3)
        ids = await asyncio.to_thread(xadd_poison, r, requests_stream(rig.prefix), payloads)
        ids += await asyncio.to_thread(xadd_poison, r, worker_stream(rig.prefix, "cpu1"), payloads)
        calls = await load
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and r.xlen(dead_stream(rig.prefix)) - dead_before < 2 * injected:
            await asyncio.sleep(0.5)
        return calls, ids

    stop, task = await _tapped(tap)
    calls, ids = await scenario()
    await asyncio.sleep(1.0)
    stop.set()
    await task
    r.xdel(worker_stream(rig.prefix, "cpu1"), *ids)  # the worker stream keeps acked entries (no trim)
    r.xdel(requests_stream(rig.prefix), *ids)
    summarize(res, calls, tap)
    told = sum(1 for rid, ts in tap.terminals.items() if rid.startswith("poison-") and ts)
    res.extra.update({"injected": 2 * injected, "dead_lettered": r.xlen(dead_stream(rig.prefix)) - dead_before,
                      "requesters_told": told, "wrong_schema_with_requester": len(payloads["wrong_schema"]),
                      "consumer_crashes": sum(1 for s, n in (("scheduler", "scheduler-0"), ("worker", "cpu1"))
                                              if rig.pid(s, n) != pids[n])})
    res.duration_s = round(time.monotonic() - t0, 1)
    res.note("kinds: truncated MessagePack, wrong schema, a 50 MB blob, 100k-deep nesting; each kind goes to "
             "the dead-letter stream on its first delivery (nothing to retry in an undecodable entry)")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert res.extra["dead_lettered"] == 2 * injected and res.extra["consumer_crashes"] == 0
    assert told == len(payloads["wrong_schema"])


@pytest.mark.parametrize("seed", SEEDS)
async def test_row13_duplicate_xadd_and_replay(rig, seed):
    res = RowResult("13", "duplicate XADD of the same request, and replays of finished ones", seed=seed)
    gw = f"relgw-13-{uuid.uuid4().hex[:6]}"
    r = rig.r()
    tap = Tap(rig.redis_url, rig.prefix)
    stop, task = await _tapped(tap)
    t0 = time.monotonic()
    reqs = [fake_request(t, gw, max_tokens=4) for _ in range(n_requests(1000) // 2) for t in KEYS]
    for i in range(0, len(reqs), 50):  # a paced stream of duplicated deliveries
        await asyncio.to_thread(xadd_requests, r, rig.prefix, reqs[i:i + 50], copies=2)
        await asyncio.sleep(0.5)
    waited = await _wait_terminals(tap, [q.request_id for q in reqs], 180)
    replay = reqs[:100]
    await asyncio.to_thread(xadd_requests, r, rig.prefix, replay)
    await asyncio.sleep(5.0)
    pending = r.xpending(requests_stream(rig.prefix), GROUP_SCHEDULER)["pending"]
    stop.set()
    await task
    _direct_figures(res, tap, [q.request_id for q in reqs])
    res.extra.update({"xadds": 2 * len(reqs) + len(replay), "replayed": len(replay), "drain_s": round(waited, 1),
                      "results_per_request_max": max(len(tap.terminals.get(q.request_id, [])) for q in reqs),
                      "started_per_request_max": max(tap.started.get(q.request_id, 0) for q in reqs),
                      "requests_pending_after": pending})
    res.duration_s = round(time.monotonic() - t0, 1)
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert res.extra["started_per_request_max"] == 1 and res.extra["results_per_request_max"] == 1
