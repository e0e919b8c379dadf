"""``slicesched bench decisions``: time per scheduling decision in the live scheduler code against a real Redis.

A decision is measured from the event in (an arrival trigger for a tenant that is behind) to the commit done
(the policy's ``decide`` over a snapshot built from the scheduler's state, the what-if, and the lease committed
through the GMG's Lua scripts with the LeaseGranted messages written to both workers' streams). The cluster and
tenants come from config files (default: 32 modelled H100s, 16 tenants); device state is synthetic (no workers):
some tenants have queued requests, the others are idle. Admission decisions (route + KV reservation + assignment)
are timed the same way.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from shared.argtypes import nonneg_int, positive_int
from shared.config import REPO_CONFIGS, Settings, load_cluster, load_tenants


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-h100x32.yaml"))
    p.add_argument("--tenants-file", default=str(REPO_CONFIGS / "tenants-16mix.yaml"))
    p.add_argument("--devices", type=positive_int, default=32, help="use the first N devices of the cluster file")
    p.add_argument("--tenants", type=positive_int, default=16, help="use the first N tenants of the tenants file")
    p.add_argument("--decisions", type=positive_int, default=500)
    p.add_argument("--warmup", type=nonneg_int, default=20,
                   help="decisions run first and not timed (the first one of a process pays one-time costs: "
                        "imports, caches); the first decision's time is reported on its own")
    p.add_argument("--policy", default="slice")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", dest="json_out", default=None)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _bench(args: argparse.Namespace, redis_url: str) -> dict:
    from dataclasses import replace

    from services.scheduler.core import DeviceView
    from services.scheduler.policy import load_live_policy
    from services.scheduler.service import SchedulerService
    from shared.config import TenantsConfig
    from shared.messages import InferenceRequest
    from shared.policies import Trigger

    full = load_cluster(args.cluster)
    cluster = replace(full, devices=full.devices[: args.devices])
    ids = {d.id for d in cluster.devices}
    tenants_all = load_tenants(args.tenants_file, full)  # per-request SLAs are priced on the home devices' kind
    kept = [t for t in tenants_all.tenants if set(t.home_devices) <= ids][: args.tenants]
    tenants = TenantsConfig(tuple(kept), tenants_all.source)
    settings = Settings(redis_url=redis_url, prefix="bench:")
    svc = SchedulerService(settings, cluster, tenants, load_live_policy(args.policy))
    await svc.gmg.register_cluster(cluster, tenants)
    await svc._refresh_devices()
    for v in svc.devices.values():
        v.up = True
    rng = random.Random(args.seed)
    now = time.time()
    behind = [t.name for t in kept[: max(1, len(kept) // 4)]]  # a quarter of the tenants are behind
    for t in behind:
        for i in range(24):
            req = InferenceRequest(msg_id=f"m{t}{i}", request_id=f"{t}-q{i}", tenant=t, gateway="bench",
                                   prompt_ids=[1] * rng.randint(512, 2048), max_tokens=rng.randint(32, 256))
            svc.core.queues.push(svc.core.pending_for(req, "0-0", now - 0.5))
    lease_ms, committed_ms = [], []
    phases: dict[str, list[float]] = {"snapshot": [], "decide": [], "commit": []}
    first_ms, granted_timed = None, 0
    for i in range(-args.warmup, args.decisions):
        t = rng.choice(behind)
        dev = rng.choice(tenants.get(t).home_devices)
        t0 = time.perf_counter()
        snap = svc.snapshot()
        t1 = time.perf_counter()
        actions = svc.core.policy.decide(Trigger("arrival", tenant=t, device=dev), snap, svc.whatif) \
            if svc.whatif is not None else []
        t2 = time.perf_counter()
        before = svc.lease_mgr.granted
        await svc.lease_mgr.apply(actions, time.time())
        t3 = time.perf_counter()
        dt = (t3 - t0) * 1e3
        if first_ms is None:
            first_ms = dt
        for lid in list(svc.lease_mgr.active):  # undo (not timed) so every decision sees the same state
            await svc.lease_mgr.revoke(lid, "bench")
        if i < 0:
            continue
        lease_ms.append(dt)
        if svc.lease_mgr.granted > before:
            committed_ms.append(dt)
            granted_timed += svc.lease_mgr.granted - before
            for k, a, b in (("snapshot", t0, t1), ("decide", t1, t2), ("commit", t2, t3)):
                phases[k].append((b - a) * 1e3)
    # admission: route + reserve KV through the GMG + write the assignment
    admit_ms = []
    for i in range(-args.warmup, args.decisions):
        t = rng.choice(kept).name
        req = InferenceRequest(msg_id=f"a{i}", request_id=f"adm-{i}", tenant=t, gateway="bench",
                               prompt_ids=[1] * 256, max_tokens=64)
        p = svc.core.pending_for(req, "0-0", time.time())
        svc.core.queues.push(p)
        t0 = time.perf_counter()
        placed = await svc._place(p)
        if i >= 0:
            admit_ms.append((time.perf_counter() - t0) * 1e3)
        if placed:
            dev = svc.assigned[req.request_id][0]
            await svc._finished(req.request_id, dev, "done")
        else:
            svc.core.queues.pop(t, req.request_id)
    await svc.redis.aclose()
    return {"policy": args.policy, "devices": len(cluster.devices), "tenants": len(kept),
            "decisions": len(lease_ms), "warmup": args.warmup, "first_decision_ms": first_ms, "p50_ms": _pct(lease_ms, 0.5), "p99_ms": _pct(lease_ms, 0.99),
            "mean_ms": statistics.fmean(lease_ms), "committed": len(committed_ms),
            "committed_p50_ms": _pct(committed_ms, 0.5), "committed_p99_ms": _pct(committed_ms, 0.99),
            "admission_p50_ms": _pct(admit_ms, 0.5), "admission_p99_ms": _pct(admit_ms, 0.99),
            "committed_phases_p50_ms": {k: _pct(v, 0.5) for k, v in phases.items()},
            "committed_phases_p99_ms": {k: _pct(v, 0.99) for k, v in phases.items()},
            "leases_per_committed_decision": granted_timed / max(1, len(committed_ms))}


def run(args: argparse.Namespace) -> int:
    from shared.logging import setup_logging
    from shared.procutil import RedisServer

    setup_logging("bench", "json", "warning")  # the scheduler's per-decision log lines are not part of the timing

    url = os.environ.get("REDIS_URL")
    with tempfile.TemporaryDirectory(prefix="slicesched-decisions-") as tmp:
        server = None if url else RedisServer(Path(tmp), appendonly=True).start()
        try:
            res = asyncio.run(_bench(args, url or server.url))
        finally:
            if server is not None:
                server.stop()
    res["machine"] = f"{os.cpu_count()}-core CPU VM"
    res["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    print(json.dumps(res, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    return 0
