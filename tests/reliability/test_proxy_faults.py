"""Matrix row 8: every service reaches Redis through :class:`~reliability.proxy.FaultProxy`, which adds 200 ms to
every reply, blackholes all traffic (half-open connections), or resets every connection with a TCP RST."""
from __future__ import annotations

import asyncio

import pytest

from reliability.results import RowResult, median
from reliability.rig import REL_REDIS, Rig
from reliability.scenario import SEEDS, finish, n_requests, run_fault_row

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(REL_REDIS == "cluster", reason="rows 8 puts a proxy in front of one redis-server; on a Redis Cluster the "
                                 "matching fault is row 22 (tests/reliability/test_failover.py)")]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig.start(tmp_path_factory.mktemp("rel-proxy"), proxy=True)
    try:
        yield r
    finally:
        r.stop()


@pytest.mark.parametrize("seed", SEEDS)
async def test_row8_latency_200ms(rig, seed):
    res = RowResult("8", "proxy between services and Redis", variant="+200 ms latency for 10 s", seed=seed)

    async def fault():
        rig.proxy.latency(0.2)
        rig.mark("proxy_latency_200ms")
        await asyncio.sleep(10.0)
        rig.proxy.latency(0.0)
        return {"latency_s": 0.2, "duration_s": 10.0}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0


@pytest.mark.parametrize("seed", SEEDS)
async def test_row8_blackhole(rig, seed):
    res = RowResult("8", "proxy between services and Redis", variant="blackhole 8 s (half-open)", seed=seed)

    async def fault():
        rig.proxy.blackhole()
        rig.mark("proxy_blackhole")
        await asyncio.sleep(8.0)
        st = rig.proxy.stats()
        rig.proxy.heal()
        rig.mark("proxy_heal")
        d = st["detections_s"]
        return {"blackhole_s": 8.0, "half_open_conns": st["watched"], "detected_conns": len(d),
                "detection_first_s": round(d[0], 2) if d else None, "detection_median_s": median(d)}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    res.note("detection: a client closing a connection that went silent (socket_timeout, health checks)")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0


@pytest.mark.parametrize("seed", SEEDS)
async def test_row8_reset(rig, seed):
    res = RowResult("8", "proxy between services and Redis", variant="RST every connection x3", seed=seed)

    async def fault():
        n = 0
        for _ in range(3):
            n += rig.proxy.reset_all()
            rig.mark("proxy_reset_all")
            await asyncio.sleep(1.0)
        return {"connections_reset": n}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-b")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
