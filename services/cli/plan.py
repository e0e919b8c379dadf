"""``slicesched plan containers``: choose each tenant's devices for a workload under the SLA, by simulation.

Static containers share nothing, so each tenant is simulated alone on 1, 2, … devices of the cluster's kind at
a rate scale, on every tuning seed; the partition sustains the scale when every tenant's violation rate stays
within the bound on every seed with the devices it needs, and those add up to no more than the cluster
(:class:`shared.sim.planner.ContainerPlanner`). The largest such scale is found by bisection; devices left over go
to the tenants closest to violating. ``--at-scale S`` instead reports how many devices each tenant needs for the
load at scale S, whatever the cluster's size (sizing a cluster for a forecast).
"""
from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time

from loadgen.mix import SCALE_MODES
from shared.argtypes import fraction, nonneg_float, positive_float, seed_list
from shared.config import load_cluster

TUNING_SEEDS = (101, 102)  # arrival seeds planning tunes on (bench compare reports other seeds)


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("containers", help="devices per tenant for a workload, planned under the SLA by simulation",
                       description=__doc__.split("\n\n")[0])
    c.add_argument("--workload", required=True, help="workload file (docs/loadgen.md)")
    c.add_argument("--cluster", required=True, help="cluster.yaml (devices of one kind)")
    c.add_argument("--seeds", type=seed_list, default=TUNING_SEEDS,
                   help=f"tuning arrival seeds (default {','.join(map(str, TUNING_SEEDS))}); every tenant must pass "
                        "on each")
    c.add_argument("--bound", type=fraction, default=0.09, help="violation rate each tenant must stay within")
    c.add_argument("--duration-s", type=positive_float, default=None, help="plan on the first D seconds only")
    c.add_argument("--scale-mode", choices=SCALE_MODES, default=None, help="how load is scaled (default: the file's)")
    c.add_argument("--tolerance", type=positive_float, default=0.03, help="bisection stop (hi/lo < 1 + tolerance)")
    c.add_argument("--deadline-chunks", action="store_true",
                   help="plan with deadline-aware chunked prefill in every replica (as simulate --deadline-chunks)")
    c.add_argument("--step-cap-s", type=nonneg_float, default=0.0, metavar="S",
                   help="plan with every replica's steps capped at S seconds while sequences decode (as simulate "
                        "--step-cap-s; 0, the default: no cap)")
    c.add_argument("--at-scale", type=positive_float, default=None,
                   help="instead: the fewest devices each tenant needs at this rate scale")
    c.add_argument("-o", "--out", default=None, help="write the containers file here")


def workload_factory(path: str, duration_s: float | None, scale_mode: str | None):
    """``(seed, scale) -> Workload`` for the planner (one file, cut and scaled as asked)."""
    from services.cli.simulate import load_workload_file

    def at(seed: int, scale: float):
        return load_workload_file(path, scale, seed, duration_s, scale_mode)
    return at


def plan_for(workload: str, cluster_path: str, seeds: tuple[int, ...], bound: float = 0.09,
             duration_s: float | None = None, scale_mode: str | None = None, tolerance: float = 0.03,
             deadline_chunks: bool = False, step_cap_s: float = 0.0):
    """Plan the partition of ``cluster_path`` for ``workload`` (returns the cluster and the Plan), the containers'
    replicas prefilling in arrival order or, with ``deadline_chunks``, first-token deadline first, their steps
    capped at ``step_cap_s`` while sequences decode (0: no cap)."""
    from shared.sim import SimConfig
    from shared.sim.planner import ContainerPlanner
    cluster = load_cluster(cluster_path)
    planner = ContainerPlanner(cluster, workload_factory(workload, duration_s, scale_mode), seeds, bound, tolerance,
                               sim_config=SimConfig(deadline_chunks=deadline_chunks, step_cap_s=step_cap_s))
    return cluster, planner.plan()


def homes_of(cluster, counts: dict[str, int]) -> dict[str, list[str]]:
    """Device ids per tenant for ``counts``: biggest containers first, filling hosts in order."""
    from shared.policies.sizing import _contiguous
    return _contiguous(counts, [(d.id, d.host) for d in cluster.devices])


def run(args: argparse.Namespace) -> int:
    from shared.containers import write_containers
    from shared.sim import SimConfig
    from shared.sim.planner import ContainerPlanner, PlanError
    cluster = load_cluster(args.cluster)
    t0 = time.perf_counter()
    planner = ContainerPlanner(cluster, workload_factory(args.workload, args.duration_s, args.scale_mode),
                               args.seeds, args.bound, args.tolerance,
                               sim_config=SimConfig(deadline_chunks=args.deadline_chunks,
                                                    step_cap_s=args.step_cap_s))
    try:
        if args.at_scale is not None:
            needs = planner.devices_for(args.at_scale)
            total = sum(n.devices for n in needs.values())
            _table(needs)
            print(f"at rate scale {args.at_scale:g}: {total} devices in all ({len(cluster.devices)} in "
                  f"{cluster.source}); every tenant within {args.bound:.0%} on seeds "
                  f"{','.join(map(str, args.seeds))} (simulated)")
            return 0
        plan = planner.plan()
    except PlanError as e:
        print(f"slicesched plan containers: {e}", file=sys.stderr)
        return 2
    _table(plan.needs)
    print(f"sustains rate scale {plan.max_scale:.3f} with every tenant within {plan.bound:.0%} on seeds "
          f"{','.join(map(str, plan.seeds))} ({plan.simulations} simulations, {time.perf_counter() - t0:.0f} s; "
          "simulated)")
    if args.out:
        meta = {"workload": args.workload, "cluster": args.cluster, "tuning_seeds": list(plan.seeds),
                "bound": plan.bound, "max_scale": round(plan.max_scale, 4), "duration_s": args.duration_s,
                "scale_mode": args.scale_mode, "deadline_chunks": args.deadline_chunks, "step_cap_s": args.step_cap_s,
                "devices": plan.counts,
                "date": dt.date.today().isoformat()}
        cmd = shlex.join(["slicesched", "plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"] else ""
        write_containers(args.out, homes_of(cluster, plan.counts), meta,
                         header=f"# planned by: {cmd}" if cmd else "")
        print(f"wrote {args.out}")
    return 0


def _table(needs) -> None:
    print(f"{'tenant':10s} {'devices':>7s} {'requests':>9s} {'violations':>10s}")
    for t, n in needs.items():
        print(f"{t:10s} {n.devices:7d} {n.requests:9d} {n.violation_rate * 100:9.2f}%")
