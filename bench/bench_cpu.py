"""``slicesched bench cpu``: the CPU time each process of the real mesh spends per request at a steady load.

Starts the mesh (a private Redis, every service, the cluster's workers), measures each process's CPU time
(user + system, all threads, from ``/proc``) over ``--idle-s`` seconds with no traffic and then over a replay of
synthetic Poisson traffic through the gateway (the accuracy bench's calibration generator: every tenant at
``--rate`` requests/s, prompts of 16–256 and outputs of 8–64 tokens, fixed seed). Per process it reports the
CPU used under load, the part above its idle use, and that part per request and per output token; and the
Redis commands per request by command (``INFO commandstats``, a steadier figure than CPU time on a shared
machine). The workers' share includes the model compute; the gateway, scheduler, simulator, GMG service and
Redis are the control plane's cost of serving requests; the load generator runs in this process and is reported
as ``client``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.launcher import MEASURE_ENV
from shared.config import REPO_CONFIGS, load_cluster, load_tenants

CONTROL_PLANE = ("gateway", "scheduler", "simulator", "gmg", "redis")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-tiny.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-tiny.yaml"))
    p.add_argument("--policy", default="container")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s per tenant (Poisson)")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds of no traffic measured first (idle baseline)")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--json", dest="json_out", default=None)


def _role(name: str) -> str:
    if name == "client":
        return "client"
    return "control plane" if name.split("-")[0] in CONTROL_PLANE else "workers"


def per_process(idle: tuple[dict, dict, float], load: tuple[dict, dict, float], requests: int,
                output_tokens: int) -> dict[str, dict[str, float]]:
    """Per process: CPU s under load, idle cores, and the CPU above idle per request (ms) and per output token
    (µs); ``idle``/``load`` are (reading before, reading after, wall seconds). Processes missing from a reading
    are left out."""
    (i0, i1, iw), (l0, l1, lw) = idle, load
    out = {}
    for name in l1:
        if name not in l0 or name not in i0 or name not in i1:
            continue
        used = l1[name] - l0[name]
        idle_cores = (i1[name] - i0[name]) / iw if iw > 0 else 0.0
        extra = max(0.0, used - idle_cores * lw)
        out[name] = {"cpu_s": used, "cores": used / lw if lw > 0 else 0.0, "idle_cores": idle_cores,
                     "ms_per_request": 1e3 * extra / max(1, requests),
                     "us_per_output_token": 1e6 * extra / max(1, output_tokens)}
    return out


def totals(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, r in rows.items():
        t = out.setdefault(_role(name), {k: 0.0 for k in r})
        for k, v in r.items():
            t[k] += v
    return out


def run(args: argparse.Namespace) -> int:
    from bench.accuracy_mesh import replay_requests
    from bench.bench_accuracy import calibration_requests
    from services.launcher import Launcher
    from services.scheduler.policy import load_live_policy
    from shared.workload import WorkloadRequest

    for flag, v, ok in (("--rate", args.rate, args.rate > 0), ("--duration-s", args.duration_s, args.duration_s > 0),
                        ("--idle-s", args.idle_s, args.idle_s >= 0)):
        if not ok:
            print(f"slicesched bench cpu: {flag} must be {'>= 0' if flag == '--idle-s' else '> 0'} (got {v:g})",
                  file=sys.stderr)
            return 2
    try:
        load_live_policy(args.policy)
    except (KeyError, ValueError) as e:
        print(f"slicesched bench cpu: --policy: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    cluster = load_cluster(args.cluster)
    tenants = load_tenants(args.tenants, cluster)
    tenants_file = str(Path(args.tenants).resolve())
    reqs = calibration_requests(tenants, args.duration_s, args.rate, args.seed)
    with tempfile.TemporaryDirectory(prefix="slicesched-bench-cpu-") as tmp:
        launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()), tenants_file=tenants_file,
                            data_dir=Path(tmp), gateway_port=0, policy=args.policy, prefix="bench:",
                            extra_env=MEASURE_ENV)
        launcher.start()
        try:
            warm = [WorkloadRequest(f"warmup-{t.name}", 0.0, t.name, 16, 4) for t in tenants.tenants]
            replay_requests(launcher.gateway_url, warm, tenants, tenants_file, 60.0)
            time.sleep(1.0)
            a, t0 = launcher.cpu_seconds(client=True), time.monotonic()
            time.sleep(args.idle_s)
            b, t1, cmds0 = launcher.cpu_seconds(client=True), time.monotonic(), command_counts(launcher.redis_url)
            records, _ = replay_requests(launcher.gateway_url, reqs, tenants, tenants_file, 120.0)
            c, t2, cmds1 = launcher.cpu_seconds(client=True), time.monotonic(), command_counts(launcher.redis_url)
            loadavg = os.getloadavg()[0]
        finally:
            launcher.stop(drain_s=10)
    if not c:
        print("error: per-process CPU times are not readable here (/proc is needed: Linux)", file=sys.stderr)
        return 1
    ok = [r for r in records if r.status == "ok"]
    out_tokens = sum(r.output_tokens for r in ok)
    rows = per_process((a, b, t1 - t0), (b, c, t2 - t1), len(ok), out_tokens)
    res: dict[str, Any] = {
        "policy": args.policy, "rate_per_tenant": args.rate, "duration_s": args.duration_s, "seed": args.seed,
        "requests": len(records), "ok": len(ok), "output_tokens": out_tokens,
        "prompt_tokens": sum(r.input_tokens for r in ok), "load_wall_s": t2 - t1, "idle_wall_s": t1 - t0,
        "processes": rows, "totals": totals(rows), "loadavg_1m_end": loadavg,
        "redis_commands_per_request": {k: round((v - cmds0.get(k, 0)) / max(1, len(ok)), 2)
                                       for k, v in sorted(cmds1.items(), key=lambda kv: -(kv[1] - cmds0.get(kv[0], 0)))
                                       if v > cmds0.get(k, 0)},
        "machine": f"{os.cpu_count()}-core {os.uname().machine}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print_report(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return 0 if ok else 1


def command_counts(redis_url: str) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``; commands that Lua scripts run are counted too)."""
    import redis as syncredis

    r = syncredis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        stats = r.info("commandstats")
    finally:
        r.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def print_report(res: dict[str, Any]) -> None:
    print(f"{res['ok']}/{res['requests']} requests ok, {res['output_tokens']} output tokens in "
          f"{res['load_wall_s']:.1f} s (policy {res['policy']}, {res['rate_per_tenant']:g} req/s per tenant)")
    print("| process | CPU s under load | cores | idle cores | CPU above idle per request (ms) "
          "| per output token (µs) |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = sorted(res["processes"].items(), key=lambda kv: (_role(kv[0]), kv[0]))
    for name, r in rows + [(f"**{k}**", v) for k, v in sorted(res["totals"].items())]:
        print(f"| {name} | {r['cpu_s']:.2f} | {r['cores']:.3f} | {r['idle_cores']:.3f} | {r['ms_per_request']:.2f} "
              f"| {r['us_per_output_token']:.0f} |")
    cmds = res["redis_commands_per_request"]
    print(f"Redis commands per request: {sum(cmds.values()):.1f} ("
          + ", ".join(f"{k} {v:g}" for k, v in list(cmds.items())[:8]) + ")")
