"""``slicesched bench simspeed``: one hour of the Azure conv trace on 32 modelled H100s with 16 tenants,
``container`` policy; reports wall seconds and events/s (target ≤ 60 s on a 2-core VM)."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from shared.argtypes import nonneg_float, nonneg_int, positive_float
from shared.config import REPO_CONFIGS, ConfigError, load_cluster, load_tenants


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=str(REPO_CONFIGS / "cluster-h100x32.yaml"))
    p.add_argument("--tenants", default=str(REPO_CONFIGS / "tenants-16mix.yaml"))
    p.add_argument("--trace", default=None, help="Azure conv CSV (default: $SLICESCHED_TRACES/azure_llm_2023_conv.csv)")
    p.add_argument("--policy", default="container")
    p.add_argument("--alpha", type=nonneg_float, default=1.3)
    p.add_argument("--rate-scale", type=positive_float, default=1.0)
    p.add_argument("--duration-s", type=positive_float, default=3600.0)
    p.add_argument("--seed", type=nonneg_int, default=1)
    p.add_argument("--json", dest="json_out", default=None)


def run(args: argparse.Namespace) -> int:
    from loadgen.workload import TraceSpec, WorkloadSpec, workload_from_spec
    from services.cli.simulate import simulate
    traces = Path(os.environ.get("SLICESCHED_TRACES", REPO_CONFIGS.parent.parent / "shared" / "traces"))
    trace = args.trace or str(traces / "azure_llm_2023_conv.csv")
    if not Path(trace).is_file():
        raise ConfigError(trace, "(file)", "trace not found (set SLICESCHED_TRACES or --trace)")
    cluster = load_cluster(args.cluster)
    load_tenants(args.tenants, cluster)
    spec = WorkloadSpec(source=Path(args.tenants).resolve().parent / "simspeed.yaml", name="simspeed-azure-conv",
                        tenants=str(Path(args.tenants).resolve()), traces=(TraceSpec(path=trace, format="azure"),),
                        seed=args.seed, duration_s=args.duration_s, alpha=args.alpha)
    t0 = time.perf_counter()
    w = workload_from_spec(spec, args.rate_scale)
    build_s = time.perf_counter() - t0
    out = simulate(cluster, w, args.policy, seed=args.seed)
    res = {"wall_s": out["wall_s"], "events": out["events"], "events_per_s": out["events_per_s"],
           "requests": len(w.requests), "simulated_s": out["end_s"],
           "speedup_vs_real_time": out["end_s"] / out["wall_s"],
           "workload_build_s": build_s, "tokens_per_s": out["tokens_per_s"], "violation_rate": out["violation_rate"],
           "policy": args.policy, "devices": len(cluster.devices), "tenants": len(w.tenants.tenants),
           "trace": trace, "alpha": args.alpha, "rate_scale": args.rate_scale, "seed": args.seed}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    print(f"simspeed: {res['requests']} requests, {res['events']} events in {res['wall_s']:.2f} s wall "
          f"({res['events_per_s']:.0f} events/s, {res['speedup_vs_real_time']:.0f}x real time; "
          f"workload built in {build_s:.2f} s)")
    return 0
