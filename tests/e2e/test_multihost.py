"""Workers and services on several "hosts": Linux network namespaces joined by veth links (tests/support/netns.py),
each with its own address. Skipped with the reason where ``ip netns add`` is not permitted (it needs root).

* a ``slice`` lease (tenant ``ta``'s MLP segments leased to the other device's worker) across hosts: Redis on one
  host, each worker on its own, every activation over the TCP tensor transport; the tokens are the ones the same
  prompts get on one host without a lease;
* (slow) the whole mesh spread over hosts: Redis, the control plane (gateway, scheduler, GMG, simulator) and each
  worker in its own namespace, a client in the root namespace.
"""
from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
import yaml

from shared.procutil import RedisServer
from support.guest_pair import DRIVER, GUEST, GuestPair
from support.mesh import REPO
from support.netns import Hosts, unavailable

pytestmark = pytest.mark.e2e

MLPS = [f"mlp[{i}]" for i in range(4)]  # the tiny preset has 4 layers
# every activation goes over the tensor transport (nothing inline); a generous timeout floor for a loaded VM
OVER_TCP = {"SLICESCHED_SEGMENT_INLINE_MAX": "0", "SLICESCHED_SEGMENT_TIMEOUT_FLOOR_MS": "500"}


@pytest.fixture
def hosts():
    why = unavailable()
    if why:
        pytest.skip(f"several hosts need network namespaces: {why}")
    h = Hosts(["redis", "w0", "w1", "ctl"]).up()
    try:
        yield h
    finally:
        h.down()


def _prompts(n: int, seed: int, length=(3, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(*length))] for _ in range(n)]


async def test_slice_lease_across_hosts_gives_the_one_host_tokens(tmp_path, hosts, redis_url, prefix):
    ps = _prompts(8, 5)
    for d in ("one-host", "hosts"):
        (tmp_path / d).mkdir()
    one = GuestPair(tmp_path / "one-host", redis_url, f"{prefix}one:", env=OVER_TCP)
    await one.start()
    try:
        alone = await one.run(DRIVER, "ta", ps, max_tokens=12)
    finally:
        await one.stop()
    redis = RedisServer(tmp_path / "redis", host=hosts.addr("redis"), wrap=hosts.wrap("redis")).start()
    pair = GuestPair(tmp_path / "hosts", redis.url, prefix, env=OVER_TCP,
                     placement={DRIVER: (hosts.wrap("w0"), hosts.addr("w0")),
                                GUEST: (hosts.wrap("w1"), hosts.addr("w1"))})
    try:
        await pair.start()
        guest = await pair.health(GUEST)
        assert guest["segment_addr"].startswith(hosts.addr("w1") + ":"), guest
        lid = await pair.grant(MLPS)
        await pair.wait_health(DRIVER, lambda h: f"{lid}:ready" in h.get("leases_driver", ""), 30)
        leased = await pair.run(DRIVER, "ta", ps, max_tokens=12)
        d, g = await pair.fresh_health(DRIVER), await pair.fresh_health(GUEST)
    finally:
        await pair.stop()
        redis.stop()
    assert {i: o.tokens for i, o in leased.items()} == {i: o.tokens for i, o in alone.items()}
    assert all(len(o.tokens) == 12 for o in alone.values())
    calls, fallbacks = int(d["remote_calls"]), int(d["remote_fallbacks"])
    assert calls > 0 and int(g["guest_served"]) > 0 and fallbacks <= calls // 10, (d, g)
    for dev in (DRIVER, GUEST):  # both workers opened the TCP tensor transport on their own address
        assert '"transport": "tcp"' in pair.log(dev), pair.log(dev)[-2000:]


def _mesh_files(tmp, hosts: Hosts) -> tuple[str, str]:
    cluster = {"cluster": {"name": "hosts", "headroom_fraction": 0.05}, "links": {"intra_host": "shm",
                                                                                  "inter_host": "tcp"},
               "devices": [{"id": d, "backend": "cpu", "kind": "cpu", "memory_gb": 0.25, "host": hosts.addr(h),
                            "threads": 1} for d, h in (("cpu0", "w0"), ("cpu1", "w1"))]}
    c = tmp / "cluster.yaml"
    c.write_text(yaml.safe_dump(cluster))
    return str(c), str(REPO / "configs" / "tenants.yaml")


@pytest.mark.slow
async def test_the_mesh_spread_over_hosts_serves_requests(tmp_path, hosts):
    redis = RedisServer(tmp_path / "redis", host=hosts.addr("redis"), wrap=hosts.wrap("redis")).start()
    cluster_file, tenants_file = _mesh_files(tmp_path, hosts)
    ctl = hosts.addr("ctl")
    base = dict(os.environ, REDIS_URL=redis.url, SLICESCHED_PREFIX="hosts:", SLICESCHED_CLUSTER=cluster_file,
                SLICESCHED_TENANTS=tenants_file, SLICESCHED_LOG_FORMAT="json", SLICESCHED_METRICS_PORT="0",
                SLICESCHED_REDIS_CLUSTER="0", PYTHONUNBUFFERED="1")
    plan = [("ctl", ["services.gmg"], {}), ("ctl", ["services.simulator"], {}), ("ctl", ["services.scheduler"], {}),
            ("w0", ["services.worker", "--device", "cpu0"], {"SLICESCHED_SEGMENT_BIND": hosts.addr("w0")}),
            ("w1", ["services.worker", "--device", "cpu1"], {"SLICESCHED_SEGMENT_BIND": hosts.addr("w1")}),
            ("ctl", ["services.gateway"], {"SLICESCHED_GATEWAY_HOST": ctl, "SLICESCHED_GATEWAY_PORT": "8000"})]
    procs = []
    try:
        for host, argv, extra in plan:
            log = open(tmp_path / f"{argv[0]}-{host}.log", "ab")
            procs.append(subprocess.Popen([*hosts.wrap(host), sys.executable, "-m", *argv], cwd=REPO,
                                          env=dict(base, **extra), stdout=log, stderr=subprocess.STDOUT))
        url = f"http://{ctl}:8000"
        deadline = time.monotonic() + 180
        while True:  # the gateway answers, and both workers have a fresh heartbeat in the GMG
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200 and _devices_ready(redis.url):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the spread mesh did not come up"
            await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as s:
            for tenant, key in (("tiny-a", "sk-dev-tiny-a-0001"), ("tiny-b", "sk-dev-tiny-b-0001")):
                async with s.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": tenant, "prompt": "across hosts", "max_tokens": 6,
                                        "ignore_eos": True}) as r:
                    body = await r.json()
                    assert r.status == 200 and body["usage"]["completion_tokens"] == 6, body
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        redis.stop()


def _devices_ready(url: str) -> bool:
    from shared.redis_util import sync_client

    r = sync_client(url, socket_timeout=2)
    try:
        return all(r.hget(f"hosts:{{gmg}}:device:{d}", "state") == b"ready" for d in ("cpu0", "cpu1"))
    finally:
        r.close()
