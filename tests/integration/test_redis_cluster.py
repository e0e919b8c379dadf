"""Redis Cluster support (docs/redis-schema.md, "Redis Cluster"): the client factories detect a cluster node, the
keys that one script or MULTI touches share a slot, per-worker and per-gateway streams spread over the masters,
the cluster client waits for a free connection as the single-server pool does, and the terminal-state fence (a
script queued in a pipeline) works on both kinds of Redis."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from redis.cluster import key_slot

from shared.config import ConfigError, redis_cluster_setting
from shared.gmg.keys import GMGKeys
from shared.messages import tokens_stream, worker_stream
from shared.redis_util import command_client, is_cluster, sync_client
from shared.requests_state import TerminalFence
from support.mesh import REPO
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)

pytestmark = pytest.mark.integration


def test_setting_is_parsed_with_a_clear_error():
    assert redis_cluster_setting({}) is None
    assert redis_cluster_setting({"SLICESCHED_REDIS_CLUSTER": "auto"}) is None
    assert redis_cluster_setting({"SLICESCHED_REDIS_CLUSTER": "1"}) is True
    assert redis_cluster_setting({"SLICESCHED_REDIS_CLUSTER": "no"}) is False
    with pytest.raises(ConfigError, match="SLICESCHED_REDIS_CLUSTER"):
        redis_cluster_setting({"SLICESCHED_REDIS_CLUSTER": "maybe"})


def test_cluster_is_detected(redis_server_url, redis_cluster_url, monkeypatch):
    monkeypatch.delenv("SLICESCHED_REDIS_CLUSTER", raising=False)
    assert is_cluster(redis_cluster_url) is True
    assert is_cluster(redis_server_url) is False
    monkeypatch.setenv("SLICESCHED_REDIS_CLUSTER", "0")  # said explicitly: not asked
    assert is_cluster(redis_cluster_url) is False


def test_gmg_keys_share_one_slot_and_streams_spread(redis_cluster_url):
    k = GMGKeys("slicesched:")
    gmg = [k.device("cpu0"), k.devices, k.reservations("cpu1"), k.resident("d7"), k.tenant("t"), k.tenants,
           k.model_graph("t"), k.pins("d"), k.lease("l1"), k.leases("d"), k.epoch, k.changes, k.exec_state("d"),
           k.requests("d"), k.finished("d"), k.busy("d")]
    assert len({key_slot(x.encode()) for x in gmg}) == 1
    r = sync_client(redis_cluster_url)
    try:
        streams = [worker_stream("slicesched:", f"cpu{i}") for i in range(8)] + \
                  [tokens_stream("slicesched:", f"gateway-{i}") for i in range(8)]
        owners = {r.get_node_from_key(s).name for s in streams}
        assert len(owners) == 3, owners  # 16 streams land on every master of the 3
        assert len({r.get_node_from_key(x).name for x in gmg}) == 1
    finally:
        r.close()


async def test_terminal_fence_claims_in_one_pipeline(redis, prefix):
    worker = TerminalFence(redis, prefix, "worker-1", owner="worker-1")
    sched = TerminalFence(redis, prefix, "scheduler")
    rids = [uuid.uuid4().hex for _ in range(12)]  # spread over the masters of a cluster
    assert await worker.claim_many([(r, "done") for r in rids[:6]]) == [True] * 6
    assert await worker.claim_many([(r, "done") for r in rids[:6]]) == [True] * 6  # idempotent for the claimant
    got = await sched.claim_many([(r, "failed") for r in rids])
    assert got == [False] * 6 + [True] * 6  # the first six were ended by the worker: fenced
    with pytest.raises(ValueError):
        await sched.claim_many([(rids[0], "running")])


async def test_cluster_client_waits_for_a_free_connection(redis_cluster_url, prefix):
    r = command_client(redis_cluster_url, max_connections=4, pool_timeout_s=10)
    try:
        key = f"{prefix}{{one}}:n"  # one slot, one node: 200 calls through at most 4 connections

        async def one(i: int) -> None:
            await r.incr(key)
            await asyncio.sleep(0)

        await asyncio.gather(*(one(i) for i in range(200)))
        assert int(await r.get(key)) == 200
        await r.delete(key)
    finally:
        await r.aclose()


def test_up_refuses_a_cluster_of_fewer_than_3_masters():
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--redis-cluster", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--redis-cluster" in out.stderr and "at least 3 masters" in out.stderr and "Traceback" not in out.stderr


def _wait_calls(node) -> int:
    for line in node.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_wait:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


async def test_durable_writes_wait_for_a_replica_and_go_on_without_a_stalled_one(tmp_path, monkeypatch):
    from shared import redis_util
    from shared.messages import CancelRequest
    from shared.procutil import LocalRedisCluster
    from shared.streams import StreamProducer

    cl = LocalRedisCluster(tmp_path / "cluster").start()
    r = command_client(cl.url)
    try:
        stream = "t:{wait}:s"
        master = cl.master_of(stream)
        replica = cl.replicas_of(master)[0]
        prod = StreamProducer(r)
        msg = CancelRequest(msg_id="m", request_id="r", tenant="t", reason="test")
        w0 = _wait_calls(master)
        await prod.add(stream, msg, durable=True)
        await prod.add(stream, msg)  # not durable: no WAIT
        assert _wait_calls(master) == w0 + 1 and _wait_calls(replica) == 0
        monkeypatch.setenv("SLICESCHED_REDIS_WAIT_MS", "300")
        lost0 = redis_util.unreplicated_writes
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await prod.add(stream, msg, durable=True)  # no replica answers: the write goes on after the wait
            slow = time.monotonic() - t0
            t0 = time.monotonic()
            await prod.add(stream, msg, durable=True)  # that master now rests from WAITs for 5 s
            fast = time.monotonic() - t0
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert slow >= 0.3 and redis_util.unreplicated_writes == lost0 + 1
        assert fast < 0.25, fast
        assert await r.xlen(stream) == 4
    finally:
        await r.aclose()
        cl.stop()
