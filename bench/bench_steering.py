"""``slicesched bench steering``: one policy on a mesh at fixed rate scales, with and without the simulator service
steering the scheduler's what-if (``SLICESCHED_SIM_STEERING`` 1 / 0), in pairs of points.

Each pair runs both settings back to back on the same workload and scale, the order alternating from pair to pair
(on-off, off-on, ...) so a drift of a shared machine's speed reaches both alike; the load average is recorded at
each point's start. A point is one mesh start, one replay, one stop (``bench.compare_mesh``); it records the
scheduler's steering gauges at its end, so a point "with" steering shows the copy's version and factor count.
For the max-sustainable-throughput search with both settings, see ``slicesched bench compare --sim-steering both``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shared.argtypes import positive_float, positive_int
from shared.config import ConfigError, load_cluster

SETTINGS = ("on", "off")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fidelity", choices=("emulated", "real"), required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--policy", default="slice")
    p.add_argument("--scales", default="1", help="comma-separated rate scales, e.g. 2,3")
    p.add_argument("--pairs", type=positive_int, default=2, help="pairs of points (one per setting) per scale")
    p.add_argument("--duration-s", type=positive_float, default=None, help="replay only the first D seconds")
    p.add_argument("--json", dest="json_out", default=None)


def _scales(raw: str) -> list[float]:
    try:
        out = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("--scales", raw, "expected comma-separated numbers, e.g. 2,3") from None
    if not out or any(not (s > 0) for s in out):
        raise ConfigError("--scales", raw, "expected positive rate scales")
    return out


def _summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        xs = [p[key] for p in points if p.get(key) is not None]
        return statistics.median(xs) if xs else None
    return {"points": len(points), "tokens_per_s_median": med("tokens_per_s"),
            "violation_rate_median": med("violation_rate"),
            "violation_rates": [round(p["violation_rate"], 4) for p in points],
            "tokens_per_s": [round(p["tokens_per_s"], 1) for p in points],
            "leases_granted": [(p.get("leases") or {}).get("granted", 0) for p in points]}


def run(args: argparse.Namespace) -> int:
    from bench.compare_mesh import run_emulated_point, run_real_point

    scales = _scales(args.scales)
    load_cluster(args.cluster)
    if not Path(args.workload).is_file():
        raise ConfigError(args.workload, "(file)", "workload file not found")
    point = run_emulated_point if args.fidelity == "emulated" else run_real_point
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for scale in scales:
        for i in range(args.pairs):
            for setting in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]):
                ns = argparse.Namespace(workload=args.workload, cluster=args.cluster, duration_s=args.duration_s,
                                        homes=None, sim_steering=setting)
                load = os.getloadavg()[0]
                r = point(ns, args.policy, scale)
                row = {"scale": scale, "pair": i, "steering": setting, "load_avg_1m": round(load, 2),
                       **{k: r.get(k) for k in ("tokens_per_s", "violation_rate", "worst_tenant_violation_rate",
                                                "leases", "wall_s", "requests")},
                       "scheduler_steering": r.get("steering")}
                rows.append(row)
                st = r.get("steering") or {}
                print(f"  scale {scale:6.3f} pair {i} steering {setting:3s}: violations "
                      f"{100 * r['violation_rate']:6.2f}%  {r['tokens_per_s']:8.1f} tok/s  leases "
                      f"{(r.get('leases') or {}).get('granted', 0):4.0f}  copy v{st.get('version', 0):.0f} "
                      f"({st.get('factors', 0):.0f} factors)  load {load:.1f}", file=sys.stderr, flush=True)
    res = {"fidelity": args.fidelity, "workload": args.workload, "cluster": args.cluster, "policy": args.policy,
           "scales": scales, "pairs": args.pairs, "duration_s": args.duration_s,
           "machine": f"{os.cpu_count()}-core CPU VM", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "wall_s": round(time.perf_counter() - t0, 1), "points": rows,
           "summary": {f"{s:g}": {st: _summary([r for r in rows if r["scale"] == s and r["steering"] == st])
                                  for st in SETTINGS} for s in scales}}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    print(f"{'scale':>6s} {'steering':>8s} {'tok/s (median)':>15s} {'violations (each point)':>28s} {'leases':>12s}")
    for s, by in res["summary"].items():
        for st, m in by.items():
            v = " ".join(f"{100 * x:.1f}%" for x in m["violation_rates"])
            print(f"{s:>6s} {st:>8s} {m['tokens_per_s_median'] or 0:15.1f} {v:>28s} "
                  f"{' '.join(f'{g:.0f}' for g in m['leases_granted']):>12s}")
    return 0
