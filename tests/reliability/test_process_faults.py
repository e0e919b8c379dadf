"""Matrix rows 1-5: services killed, stopped and terminated under load (the launcher restarts what dies).

Each tenant lives on one home worker, so a dead worker's requests are not re-run elsewhere: the scheduler ends
them with a clear, retryable ``worker_failed`` error, and queued requests wait for the restarted worker.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from reliability.load import Driver
from reliability.results import RowResult, summarize
from reliability.rig import Rig
from reliability.scenario import SEEDS, finish, n_requests, run_fault_row, seed_base
from reliability.tap import Tap, with_tap
from shared.messages import GROUP_WORKER, worker_stream

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig.start(tmp_path_factory.mktemp("rel-proc"))
    try:
        yield r
    finally:
        r.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_row1_kill_worker_mid_generation(rig, seed):
    res = RowResult("1", "kill -9 a worker mid-generation", seed=seed)

    async def fault():
        pid = rig.signal("worker", "cpu0", signal.SIGKILL)
        restart = await asyncio.to_thread(rig.wait_new_pid, "worker", "cpu0", pid)
        return {"worker_restart_s": round(restart, 2)}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    res.note("home-pinned tenants: in-flight requests of the dead worker end with a retryable worker_failed "
                 "error (not re-run elsewhere); queued ones run after the restart")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0


@pytest.mark.parametrize("seed", SEEDS)
async def test_row2_sigstop_worker_past_heartbeat_timeout(rig, seed):
    res = RowResult("2", "SIGSTOP a worker past the heartbeat timeout, then SIGCONT", seed=seed)

    async def fault():
        pid = rig.signal("worker", "cpu1", signal.SIGSTOP)
        await asyncio.sleep(6.0)  # > the 3 s heartbeat staleness after which its requests are failed
        os.kill(pid, signal.SIGCONT)
        rig.mark("SIGCONT worker:cpu1")
        await asyncio.sleep(3.0)  # let the zombie's late writes happen while the tap watches
        return {"stopped_s": 6.0}

    _, calls, tap = await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-b")
    res.extra["fenced_or_late_chunks"] = sum(tap.late_chunks.values())
    res.note("the woken worker's results for requests already failed must not reach the gateway as a 2nd result")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0


@pytest.mark.parametrize("seed", SEEDS)
async def test_row3_long_healthy_generation_is_not_reclaimed(rig, seed):
    """Long generations beside normal load: no spurious worker_failed, no redelivery, no re-execution."""
    res = RowResult("3", "long healthy generations (no spurious reclaim)", seed=seed)
    driver = Driver(rig.mesh.gateway, seed_base=seed_base("3", seed), max_tokens=6)
    long_driver = Driver(rig.mesh.gateway, seed_base=seed_base("3L", seed), max_tokens=1500)
    tap = Tap(rig.redis_url, rig.prefix)
    max_deliveries = 0

    async def sample_pending(stop: asyncio.Event):
        nonlocal max_deliveries
        r = rig.r()
        while not stop.is_set():
            for d in ("cpu0", "cpu1"):
                for p in await asyncio.to_thread(r.xpending_range, worker_stream(rig.prefix, d), GROUP_WORKER,
                                                 "-", "+", 100):
                    max_deliveries = max(max_deliveries, int(p["times_delivered"]))
            await asyncio.sleep(1.0)

    async def scenario():
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_pending(stop))
        longs = asyncio.create_task(long_driver.closed_loop(6, 6))
        short = await driver.open_loop(n_requests(400), 12, random.Random(seed))
        long_calls = await longs
        stop.set()
        await sampler
        return short + long_calls

    t0 = time.monotonic()
    calls = await with_tap(tap, scenario())
    summarize(res, calls, tap)
    long_e2e = [c.e2e for c in long_driver.calls if c.outcome == "ok" and c.e2e]
    res.extra.update({"long_requests": 6, "long_e2e_max_s": round(max(long_e2e), 1) if long_e2e else None,
                      "max_times_delivered_worker_streams": max_deliveries,
                      "spurious_worker_failed": res.errors.get("worker_failed", 0)})
    res.duration_s = round(time.monotonic() - t0, 1)
    res.note("worker streams have one fixed owner (consumer = device id) and no reclaim; the failure detector "
                 "that could misfire is the 3 s heartbeat staleness")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert res.errors.get("worker_failed", 0) == 0 and max_deliveries <= 1 and res.extra["reexecuted"] == 0
    assert len(long_e2e) == 6 and min(long_e2e) > 0


@pytest.mark.parametrize("service,name", [("scheduler", "scheduler-0"), ("simulator", "simulator"), ("gmg", "gmg")])
@pytest.mark.parametrize("seed", SEEDS)
async def test_row4_kill_control_plane_service(rig, service, name, seed):
    res = RowResult("4", "kill -9 a control-plane service (launcher restarts it)", variant=service, seed=seed)

    async def fault():
        pid = rig.signal(service, name, signal.SIGKILL)
        restart = await asyncio.to_thread(rig.wait_new_pid, service, name, pid)
        return {"restart_s": round(restart, 2)}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert not res.errors.get("worker_failed"), f"healthy workers' requests were failed: {res.errors}"


@pytest.mark.parametrize("seed", SEEDS)
async def test_row5_sigterm_worker_drains(rig, seed):
    res = RowResult("5", "SIGTERM a worker (graceful drain)", seed=seed)

    async def fault():
        pid = rig.signal("worker", "cpu1", signal.SIGTERM)
        t0 = time.monotonic()
        while True:  # the drain ends when the process exits
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] == "Z":
                        break
            except (ProcessLookupError, FileNotFoundError):
                break
            await asyncio.sleep(0.05)
        drain = time.monotonic() - t0
        restart = await asyncio.to_thread(rig.wait_new_pid, "worker", "cpu1", pid)
        return {"drain_s": round(drain, 2), "restart_s": round(restart, 2)}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-b")
    res.note("in-flight requests end with a retryable worker_draining error; the launcher restarts the worker")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
