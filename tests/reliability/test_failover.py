"""Matrix row 22: Redis failover. The mesh runs on a private Redis Cluster (3 masters, one replica each, node
timeout 2 s); under load, ``kill -9`` the master that serves one of the mesh's key families, its replica takes
over, then the killed node is started again (it rejoins as a replica). Variants: the master of the ``requests``
stream, of the ``{gmg}`` keys, and of the gateway's tokens stream.

Replication is asynchronous: a write a master acknowledged may not have reached its replica when the master dies.
Two harness writers measure that window on the killed master itself, each XADDing a sequence number every 5 ms: one
with plain XADDs, one the way the mesh writes what hands a request on (XADD then ``WAIT 1``, on the same
connection: :func:`shared.redis_util.run_pipeline`). Acknowledged entries missing after the failover are lost.
"""
from __future__ import annotations

import asyncio
import signal
import time

import pytest
from redis.cluster import key_slot

from reliability.results import RowResult
from reliability.rig import Rig
from reliability.scenario import SEEDS, finish, n_requests, run_fault_row
from shared.gmg.keys import GMGKeys
from shared.messages import requests_stream, tokens_stream
from shared.redis_util import command_client, run_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig.start(tmp_path_factory.mktemp("rel-failover"), redis="cluster")
    try:
        yield r
    finally:
        r.stop()


class AckedWriter:
    """XADDs ``seq`` to ``stream`` every ``interval_s``; remembers which XADDs were acknowledged, and when.
    ``durable``: each XADD is followed by WAIT 1 on its connection, as the mesh's hand-over writes are."""

    def __init__(self, url: str, stream: str, *, durable: bool, interval_s: float = 0.005) -> None:
        self.url, self.stream, self.durable, self.interval_s = url, stream, durable, interval_s
        self.acked: list[tuple[int, float]] = []
        self.errors = 0

    async def run(self, stop: asyncio.Event) -> None:
        r = command_client(self.url, socket_timeout_s=1.0, name="rel-acked-writer")
        seq = 0
        try:
            while not stop.is_set():
                seq += 1
                try:
                    if self.durable:
                        await run_pipeline(r, lambda p: p.xadd(self.stream, {"seq": seq}), replicate=[self.stream])
                    else:
                        await r.xadd(self.stream, {"seq": seq})
                    self.acked.append((seq, time.time()))
                except Exception:  # the master is down: the row measures that
                    self.errors += 1
                    await asyncio.sleep(0.05)
                await asyncio.sleep(self.interval_s)
        finally:
            await r.aclose()

    def lost(self, surviving: set[int], kill_ts: float) -> tuple[int, int]:
        before = [s for s, t in self.acked if t <= kill_ts]
        return len(before), sum(1 for s in before if s not in surviving)


def _stream_on(rig: Rig, master, name: str) -> str:
    """A key of the harness that lives on ``master`` (a hash tag chosen for its slot)."""
    for i in range(100_000):
        key = f"{rig.prefix}rel:{name}:{{m{i}}}"
        if rig.cluster.master_of_slot(key_slot(key.encode())) is master:
            return key
    raise RuntimeError("no key found for that master")


def _gateway_id(rig: Rig) -> str:
    r = rig.r()
    for k in r.scan_iter(match=f"{rig.prefix}health:gateway:*"):
        return k.decode().rsplit(":", 1)[1]
    raise RuntimeError("no gateway health key")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", ["requests", "gmg", "tokens"])
async def test_row22_kill_a_master_under_load(rig, family, seed):
    p = rig.prefix
    key = {"requests": requests_stream(p), "gmg": GMGKeys(p).epoch,
           "tokens": tokens_stream(p, _gateway_id(rig))}[family]
    master = rig.cluster.master_of(key)
    families = {f: rig.cluster.master_of(k) is master for f, k in (
        ("requests", requests_stream(p)), ("gmg", GMGKeys(p).epoch), ("tokens", tokens_stream(p, _gateway_id(rig))))}
    res = RowResult("22", "kill -9 a Redis Cluster master under load (its replica takes over)",
                    variant=f"master of {family}", seed=seed)
    res.redis = "cluster"
    writers = [AckedWriter(rig.redis_url, _stream_on(rig, master, f"plain{seed}"), durable=False),
               AckedWriter(rig.redis_url, _stream_on(rig, master, f"waited{seed}"), durable=True)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in writers]
    info: dict = {}

    async def fault():
        await asyncio.sleep(1.0)
        replica = rig.cluster.replicas_of(master)[0]
        info["kill_ts"] = time.time()
        t0 = time.monotonic()
        master.kill()
        rig.mark(f"SIGKILL redis master :{master.port} ({family})")
        while True:  # until the replica serves the slot
            try:
                if rig.cluster.master_of(key) is replica:
                    break
            except RuntimeError:
                pass
            await asyncio.sleep(0.05)
        failover = time.monotonic() - t0
        rig.mark(f"replica :{replica.port} promoted")
        await asyncio.to_thread(master.start)  # the old master rejoins as a replica of the new one
        await asyncio.to_thread(rig.cluster.wait_ok, 30)
        return {"failover_s": round(failover, 2), "signal": signal.SIGKILL.name}

    try:
        _, calls, tap = await run_fault_row(rig, res, n=n_requests(1000), fault=fault, probe_tenant="tiny-a")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    r = rig.r()
    for w, name in zip(writers, ("plain", "waited")):
        surviving = {int(f[b"seq"]) for _, f in r.xrange(w.stream)}
        acked, lost = w.lost(surviving, info["kill_ts"])
        res.extra[f"acked_{name}"], res.extra[f"acked_{name}_lost"] = acked, lost
        r.delete(w.stream)
    res.extra["same_master"] = ",".join(f for f, same in families.items() if same)
    res.note("plain: XADDs the master acknowledged; waited: XADD + WAIT 1 on the same connection, as the mesh writes "
             "requests, assignments, final chunks, errors, terminal claims, RequestFinished and GMG commits")
    finish(rig, res)
    assert res.lost == 0 and res.duplicated == 0
    assert res.extra["acked_waited_lost"] == 0
