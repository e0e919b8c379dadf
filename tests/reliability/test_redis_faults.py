"""Matrix rows 6 and 7: Redis itself fails. Row 7 stalls every client with ``CLIENT PAUSE 10000 ALL``; row 6
kills redis-server with ``kill -9`` under AOF ``always``, ``everysec`` and off, and restarts it on the same port and
data directory. Besides the mesh's requests, a harness writer XADDs a sequence number every 5 ms so the loss window of
acknowledged writes can be measured exactly per persistence setting."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from reliability.results import RowResult
from reliability.rig import REL_REDIS, Rig
from reliability.scenario import SEEDS, finish, n_requests, run_fault_row

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(REL_REDIS == "cluster", reason="rows 6 and 7 fault one redis-server; on a Redis Cluster the "
                                 "matching fault is row 22 (tests/reliability/test_failover.py)")]

DOWN_S = 4.0


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig.start(tmp_path_factory.mktemp("rel-redis"), appendfsync="always")
    try:
        yield r
    finally:
        r.stop()


class AckedWriter:
    """XADDs ``seq`` every ``interval_s`` to one stream and remembers which XADDs Redis acknowledged, and when."""

    def __init__(self, url: str, stream: str, interval_s: float = 0.005) -> None:
        self.url, self.stream, self.interval_s = url, stream, interval_s
        self.acked: list[tuple[int, float]] = []
        self.errors = 0

    async def run(self, stop: asyncio.Event) -> None:
        r = aioredis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=0.5)
        seq = 0
        try:
            while not stop.is_set():
                seq += 1
                try:
                    await r.xadd(self.stream, {"seq": seq})
                    self.acked.append((seq, time.time()))
                except Exception:  # Redis down: the row measures that
                    self.errors += 1
                    await asyncio.sleep(0.05)
                await asyncio.sleep(self.interval_s)
        finally:
            await r.aclose()

    def lost(self, surviving: set[int], kill_ts: float) -> dict:
        before = [(s, t) for s, t in self.acked if t <= kill_ts]
        lost = [(s, t) for s, t in before if s not in surviving]
        return {"acked_before_kill": len(before), "acked_writes_lost": len(lost),
                "loss_window_ms": round((kill_ts - min(t for _, t in lost)) * 1000, 1) if lost else 0.0}


def _groups(rig: Rig) -> set[tuple[str, str]]:
    """(stream, group) pairs of the mesh's consumer-group streams."""
    r = rig.r()
    out = set()
    for key in r.scan_iter(match=f"{rig.prefix}*", _type="stream"):
        for g in r.xinfo_groups(key):
            out.add((key.decode(), g["name"].decode()))
    return out


@pytest.mark.parametrize("seed", SEEDS)
async def test_row7_client_pause_all(rig, seed):
    res = RowResult("7", "Redis stall: CLIENT PAUSE 10000 ALL", seed=seed)

    async def fault():
        r = rig.r()
        r.execute_command("CLIENT", "PAUSE", 10000, "ALL")
        rig.mark("client_pause")
        await asyncio.sleep(10.5)
        return {"paused_s": 10.0}

    await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    res.note("requests finish or fail within their deadline; blocked calls resume or time out (socket_timeout)")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["always", "everysec", "off"])
async def test_row6_kill_redis(rig, mode, seed):
    aof = mode != "off"
    fsync = mode if aof else "everysec"
    rig.set_persistence(appendonly=aof, appendfsync=fsync)
    res = RowResult("6", "kill -9 redis-server, restart on the same port and dir", variant=f"AOF {mode}", seed=seed)
    groups_before = _groups(rig)
    writer = AckedWriter(rig.redis_url, f"{rig.prefix}rel:acked")
    stop = asyncio.Event()
    wtask = asyncio.create_task(writer.run(stop))
    info: dict = {}

    async def fault():
        await asyncio.sleep(1.0)
        kill_ts = rig.kill_redis()
        await asyncio.sleep(DOWN_S)
        rig.restart_redis(appendonly=aof, appendfsync=fsync)
        info["kill_ts"] = kill_ts
        return {"down_s": DOWN_S}

    try:
        _, calls, tap = await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-b",
                                            probe_timeout_s=150)
    finally:
        stop.set()
        await wtask
    r = rig.r()
    surviving = {int(f[b"seq"]) for _, f in r.xrange(f"{rig.prefix}rel:acked")}
    r.delete(f"{rig.prefix}rel:acked")
    res.extra.update(writer.lost(surviving, info["kill_ts"]))
    res.extra["groups_recreated"] = _groups(rig) >= groups_before
    down = [c for c in calls if c.status == 503]
    res.extra["http_503"] = len(down)
    res.extra["http_503_with_retry_after"] = sum(1 for c in down if c.retry_after)
    if mode == "off":
        res.note("AOF off: every stream, group and GMG key is gone after the restart (documented loss window)")
    elif mode == "everysec":
        res.note("AOF everysec: a killed redis-server loses no acknowledged write (the AOF is written before the "
                 "reply; only fsync is deferred), the <= 1 s window is for an OS crash or power loss")
    else:
        res.note("AOF always: no acknowledged write is lost")
    finish(rig, res, allow_lost=mode == "off", must_settle=mode != "off")
    if mode == "always":
        assert res.extra["acked_writes_lost"] == 0
    if mode == "everysec":
        assert res.extra["loss_window_ms"] <= 2000
    assert res.extra["groups_recreated"], f"consumer groups missing after the restart: {groups_before}"
    assert down and all(c.retry_after for c in down), "Redis down must answer 503 with Retry-After"
    assert all(c.status in (200, 429, 503) for c in calls if c.status is not None), res.extra["http_errors"]
