"""``slicesched bench whatif``: latency of a what-if RPC (query XADD -> simulator service -> reply read) for a
batch of candidates on a twin of a modelled cluster with synthetic device state (no workers).

Starts a private redis-server and the real simulator service (``python -m services.simulator``) as a subprocess,
writes synthetic GMG state through the GMG store, then times ``WhatIfClient.whatif`` calls one after another.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.argtypes import nonneg_int, positive_float, positive_int
from shared.config import REPO_CONFIGS, load_cluster, load_tenants


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-h100x32.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-16mix.yaml"))
    p.add_argument("--queries", type=positive_int, default=2000)
    p.add_argument("--warmup", type=nonneg_int, default=100)
    p.add_argument("--candidates", type=positive_int, default=8, help="candidates per query")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-ms", type=positive_float, default=1000.0,
                   help="per-query RPC timeout; a query past it counts at this latency, and in `timeouts`")
    p.add_argument("--in-process", action="store_true",
                   help="time the evaluation alone: the service's core called in this process, no RPC (separates "
                        "the evaluation's own tail from the trips through Redis)")
    p.add_argument("--json", dest="json_out", default=None)


def _candidates(rng: random.Random, cluster, tenants, n: int):
    from shared.messages import WhatIfCandidate

    ids = [d.id for d in cluster.devices]
    out = []
    for i in range(n):
        t = rng.choice(tenants.tenants)
        if i % 4 == 3:  # an admission on one of its homes
            out.append(WhatIfCandidate(kind="admit", tenant=t.name, device=rng.choice(t.home_devices),
                                       input_tokens=rng.randint(64, 2048), output_tokens=rng.randint(16, 256)))
            continue
        guest = rng.choice([d for d in ids if d not in t.home_devices])
        layers = t.model.config.num_hidden_layers
        segs = sorted(rng.sample(range(layers), rng.randint(1, 8)))
        out.append(WhatIfCandidate(kind="lease", tenant=t.name, device=guest, home_device=t.home_devices[0],
                                   segments=[f"mlp[{x}]" for x in segs], duration_s=rng.uniform(0.05, 1.0),
                                   share=rng.uniform(0.2, 0.9), memory_bytes=rng.randint(1, 512) << 20))
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc), 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _bench(args, cluster, tenants, url: str, prefix: str, data_dir: Path, redis_pid: int = 0) -> dict:
    from shared.gmg import GMGStore
    from shared.messages import requests_stream
    from shared.redis_util import command_client
    from shared.service import health_key
    from shared.streams import StreamProducer
    from services.simulator.client import WhatIfClient, WhatIfTimeout
    from bench.synthetic_state import write_synthetic_state

    rng = random.Random(args.seed)
    redis = command_client(url)
    reqs = await write_synthetic_state(GMGStore(redis, prefix), cluster, tenants, rng)
    await StreamProducer(redis).add_many([(requests_stream(prefix), r) for r in reqs])
    env = dict(os.environ, REDIS_URL=url, SLICESCHED_PREFIX=prefix, SLICESCHED_CLUSTER=args.cluster,
               SLICESCHED_TENANTS=args.tenants, SLICESCHED_LOG_FORMAT="json", SLICESCHED_METRICS_PORT="0")
    log = open(data_dir / "simulator.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.simulator"], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while await redis.hget(health_key(prefix, "simulator", "simulator"), "ready") != b"1":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulator did not start; see {data_dir / 'simulator.log'}")
            await asyncio.sleep(0.1)
        client = await WhatIfClient(redis, url, prefix).start()
        lat, compute, outcomes, timeouts = [], [], 0, 0
        pids = {"client": os.getpid(), "simulator": proc.pid, "redis": redis_pid}
        cpu0, load0, wall0 = {}, os.getloadavg()[0], 0.0
        try:
            for i in range(args.warmup + args.queries):
                if i == args.warmup:
                    cpu0, wall0 = {k: _cpu_s(p) for k, p in pids.items()}, time.perf_counter()
                cands = _candidates(rng, cluster, tenants, args.candidates)
                t0 = time.perf_counter()
                try:
                    reply = await client.whatif(cands, timeout_s=args.timeout_ms / 1e3)
                except WhatIfTimeout:  # no answer in time: a latency of at least the timeout, never dropped
                    if i >= args.warmup:
                        lat.append(args.timeout_ms)
                        timeouts += 1
                    continue
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    lat.append(dt * 1e3)
                    compute.append(reply.compute_ms)
                    outcomes += len(reply.outcomes)
            cpu = {k: (_cpu_s(p) - cpu0[k]) / max(1, args.queries) * 1e3 for k, p in pids.items()}
            wall = time.perf_counter() - wall0
        finally:
            await client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        await redis.aclose()
    return {"mode": "rpc", "queries": len(lat), "candidates_per_query": args.candidates, "devices": len(cluster.devices),
            "tenants": len(tenants.tenants), "outcomes": outcomes, "timeouts": timeouts, "timeout_ms": args.timeout_ms,
            "rpc_ms": {"p50": _pct(lat, 0.5), "p90": _pct(lat, 0.9), "p99": _pct(lat, 0.99), "max": max(lat)},
            "compute_ms": {"p50": _pct(compute, 0.5), "p99": _pct(compute, 0.99)},
            "cpu_ms_per_query": {k: round(v, 3) for k, v in cpu.items()},  # simulator's includes its refresh loops
            "loadavg_1m": {"start": load0, "end": os.getloadavg()[0]}, "wall_s": wall,
            "target_p99_ms": 5.0, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


async def _bench_in_process(args, cluster, tenants, url: str, prefix: str) -> dict:
    """The same synthetic twin and queries, answered by :class:`SimulatorCore` in this process: no Redis trips, no
    other process, no refresh loop — what is left in the tail is the evaluation's and the machine's."""
    from shared.gmg import GMGStore
    from shared.gmg.follower import GMGFollower
    from shared.messages import WhatIfQuery
    from shared.redis_util import command_client
    from services.simulator.core import SimulatorCore
    from bench.synthetic_state import write_synthetic_state

    rng = random.Random(args.seed)
    redis = command_client(url)
    try:
        await write_synthetic_state(GMGStore(redis, prefix), cluster, tenants, rng)
        follower = GMGFollower(redis, prefix)
        await follower.load()
    finally:
        await redis.aclose()
    core = SimulatorCore(cluster, tenants)
    core.refresh(follower.snapshot, time.time())
    lat, outcomes = [], 0
    for i in range(args.warmup + args.queries):
        q = WhatIfQuery(msg_id=str(i), query_id=str(i), client="bench",
                        candidates=_candidates(rng, cluster, tenants, args.candidates))
        t0 = time.perf_counter()
        reply = core.answer(q, time.time())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            lat.append(dt)
            outcomes += len(reply.outcomes)
    return {"mode": "in_process", "queries": len(lat), "candidates_per_query": args.candidates,
            "devices": len(cluster.devices), "tenants": len(tenants.tenants), "outcomes": outcomes,
            "compute_ms": {"p50": _pct(lat, 0.5), "p90": _pct(lat, 0.9), "p99": _pct(lat, 0.99), "max": max(lat)},
            # the 20 slowest queries (index after warm-up, ms): the same --seed replays the same queries, so two runs
            # tell a query that is slow to evaluate from a moment when the machine was slow
            "slowest": [[i, round(lat[i], 3)] for i in sorted(range(len(lat)), key=lambda i: -lat[i])[:20]],
            "loadavg_1m": os.getloadavg()[0], "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def run(args: argparse.Namespace) -> int:
    from shared.procutil import RedisServer

    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    with tempfile.TemporaryDirectory(prefix="bench-whatif-") as tmp:
        server = RedisServer(data_dir=Path(tmp) / "redis").start()
        try:
            if args.in_process:
                res = asyncio.run(_bench_in_process(args, cluster, tenants, server.url, "bench:"))
            else:
                res = asyncio.run(_bench(args, cluster, tenants, server.url, "bench:", Path(tmp),
                                         server.proc.pid if server.proc else 0))
        finally:
            server.stop()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    if args.in_process:
        c = res["compute_ms"]
        print(f"what-if evaluation in process (no RPC), {res['candidates_per_query']} candidates, "
              f"{res['devices']}-device twin ({res['tenants']} tenants), {res['queries']} queries")
        print(f"  ms: p50 {c['p50']:.2f}  p90 {c['p90']:.2f}  p99 {c['p99']:.2f}  max {c['max']:.2f}")
        return 0
    r, c = res["rpc_ms"], res["compute_ms"]
    print(f"what-if RPC, {res['candidates_per_query']} candidates, {res['devices']}-device twin "
          f"({res['tenants']} tenants), {res['queries']} queries")
    print(f"  round trip ms: p50 {r['p50']:.2f}  p90 {r['p90']:.2f}  p99 {r['p99']:.2f}  max {r['max']:.2f}  "
          f"(target p99 <= {res['target_p99_ms']:.0f})")
    print(f"  server compute ms: p50 {c['p50']:.2f}  p99 {c['p99']:.2f}")
    if res["timeouts"]:
        print(f"  {res['timeouts']} queries got no reply within {res['timeout_ms']:g} ms (counted at that latency)")
    cpu = res["cpu_ms_per_query"]
    print(f"  CPU ms per query: client {cpu['client']:.2f}  simulator {cpu['simulator']:.2f}  "
          f"redis {cpu['redis']:.2f}  (1-min load average {res['loadavg_1m']['start']:.1f} -> "
          f"{res['loadavg_1m']['end']:.1f} on {os.cpu_count()} CPUs)")
    return 0
