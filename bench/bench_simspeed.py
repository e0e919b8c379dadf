"""``slicesched bench simspeed``: how fast the offline simulator replays a workload.

Default: one hour of the Azure mix (``configs/workloads/azure-16mix-a1.3.yaml``: conv + code traces over the 16
tenants of ``configs/tenants-16mix.yaml``) on the 32 modelled H100s, ``container`` policy. ``--trace CSV`` replays
one Azure trace over the same tenants instead (the older form of this benchmark). Reports wall and CPU seconds of
the simulation (the workload build apart), events/s and the 1-minute load average before and after: on a shared
machine wall time depends on the others' load, CPU time much less.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

from shared.argtypes import nonneg_float, nonneg_int, positive_float
from shared.config import REPO_CONFIGS, ConfigError, load_cluster, load_tenants

DEFAULT_WORKLOAD = REPO_CONFIGS / "workloads" / "azure-16mix-a1.3.yaml"


def configure(p: argparse.ArgumentParser) -> None:
    from loadgen.mix import SCALE_MODES
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-h100x32.yaml"))
    p.add_argument("--workload", default=None,
                   help=f"workload file (default: {DEFAULT_WORKLOAD.relative_to(REPO_CONFIGS.parent)})")
    p.add_argument("--trace", default=None,
                   help="instead of a workload file: one Azure CSV over --tenants with popularity --alpha")
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-16mix.yaml"), help="with --trace")
    p.add_argument("--alpha", type=nonneg_float, default=1.3, help="with --trace")
    p.add_argument("--policy", default="container")
    p.add_argument("--rate-scale", type=positive_float, default=None, help="default: the workload's (1 with --trace)")
    p.add_argument("--scale-mode", choices=SCALE_MODES, default=None, help="default: the workload's")
    p.add_argument("--containers", default="homes", metavar="homes|sized|FILE",
                   help="the static partition (as `slicesched simulate --containers`)")
    p.add_argument("--duration-s", type=positive_float, default=3600.0)
    p.add_argument("--seed", type=nonneg_int, default=1)
    p.add_argument("--json", dest="json_out", default=None)


def _spec(args: argparse.Namespace, cluster_path: str):
    from loadgen.workload import TraceSpec, WorkloadSpec, read_workload_spec
    if args.trace is None:
        spec = read_workload_spec(args.workload or DEFAULT_WORKLOAD)
        spec = dataclasses.replace(spec, seed=args.seed, duration_s=args.duration_s)
    else:
        if not Path(args.trace).is_file():
            raise ConfigError(args.trace, "(file)", "trace not found")
        spec = WorkloadSpec(source=Path(args.tenants).resolve().parent / "simspeed.yaml", name="simspeed-azure-trace",
                            tenants=str(Path(args.tenants).resolve()),
                            traces=(TraceSpec(path=args.trace, format="azure"),), seed=args.seed,
                            duration_s=args.duration_s, alpha=args.alpha, cluster=cluster_path)
    if args.scale_mode is not None:
        spec = dataclasses.replace(spec, scale_mode=args.scale_mode)
    return spec


def run(args: argparse.Namespace) -> int:
    from loadgen.workload import workload_from_spec
    from services.cli.simulate import check_tenants_fit, simulate
    cluster = load_cluster(args.cluster)
    if args.trace is not None:
        load_tenants(args.tenants, cluster)
    spec = _spec(args, str(Path(args.cluster).resolve()))
    t0 = time.perf_counter()
    w = workload_from_spec(spec, args.rate_scale)
    scale = spec.rate_scale if args.rate_scale is None else args.rate_scale
    build_s = time.perf_counter() - t0
    check_tenants_fit(cluster, w)
    load0, cpu0 = os.getloadavg(), time.process_time()
    out = simulate(cluster, w, args.policy, seed=args.seed, containers=args.containers)
    cpu_s, load1 = time.process_time() - cpu0, os.getloadavg()
    res = {"wall_s": out["wall_s"], "cpu_s": cpu_s, "events": out["events"], "events_per_s": out["events_per_s"],
           "requests": len(w.requests), "simulated_s": out["end_s"],
           "speedup_vs_real_time": out["end_s"] / out["wall_s"],
           "workload_build_s": build_s, "tokens_per_s": out["tokens_per_s"], "violation_rate": out["violation_rate"],
           "policy": args.policy, "devices": len(cluster.devices), "tenants": len(w.tenants.tenants),
           "workload": w.name, "trace": args.trace, "rate_scale": scale, "scale_mode": spec.scale_mode,
           "containers": args.containers, "duration_s": args.duration_s, "seed": args.seed,
           "loadavg_1m": {"start": load0[0], "end": load1[0]},
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d", time.gmtime())}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    print(f"simspeed ({args.policy}, {w.name}, rate scale {scale:g} {spec.scale_mode}): "
          f"{res['requests']} requests, {res['events']} events in {res['wall_s']:.2f} s wall, {cpu_s:.2f} s CPU "
          f"({res['events_per_s']:.0f} events/s, {res['speedup_vs_real_time']:.0f}x real time; workload built in "
          f"{build_s:.2f} s; 1-min load {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0
