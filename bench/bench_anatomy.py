"""``slicesched bench anatomy``: where the violations are at `slice`'s boundary, and what idle capacity existed.

Reads a simulated ``bench compare`` result (``--from``: its workload, cluster, partition, trace length and first
reporting seed) and replays each policy in ``--policies`` at one rate scale — by default the largest scale at which
``slice`` stayed within the bound there — recording every device's busy time; each policy in ``--own-boundary``
(default ``container``) also runs at its own boundary, to show how busy the cluster already is where it stops. For
each policy it reports the violations by cause and tenant, how late the TTFT violations were, how busy the tenant's
own container was during those waits, and how many device-equivalents stood idle outside it meanwhile
(:mod:`shared.sim.anatomy`). All policies run at the same load, so the rows compare directly; each prefills as it
did in the source run (deadline-aware chunks and step caps as its ``deadline_chunks`` and ``step_cap_s`` say). Simulated
only.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from shared.argtypes import positive_float
from shared.config import ConfigError, load_cluster
from shared.sim.anatomy import DEFAULT_BIN_S

BOUNDS = ("9", "1")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, metavar="COMPARE_JSON",
                   help="a simulated `bench compare` result (e.g. docs/results/sim-azure-16mix-a1.3.json)")
    p.add_argument("--policies", default="container,slice", help="policies replayed at the same scale")
    p.add_argument("--bound", choices=BOUNDS, default="9", help="whose boundary: ≤ 9%% (default) or ≤ 1%%")
    p.add_argument("--at", default="slice", help="the policy whose boundary scale every policy runs at")
    p.add_argument("--scale", type=positive_float, default=None, help="run at this rate scale instead")
    p.add_argument("--own-boundary", default="container",
                   help="policies also replayed at their own boundary (default container: how busy the cluster "
                        "already is where the baseline stops; '' for none)")
    p.add_argument("--bin-s", type=positive_float, default=DEFAULT_BIN_S, help="busy-time bin (s)")
    p.add_argument("--json", dest="json_out", default=None)


def _load_source(path: str) -> dict[str, Any]:
    p = Path(_in_repo(path))
    if not p.is_file():
        raise ConfigError(path, "--from", "file not found")
    try:
        src = json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError(path, "--from", f"not JSON: {e}") from None
    for key in ("workload", "cluster", "per_seed", "policies"):
        if key not in src:
            raise ConfigError(path, key, "missing: not a `bench compare` result")
    if src.get("fidelity", "sim") != "sim":
        raise ConfigError(path, "fidelity", f"{src.get('fidelity')!r}: anatomy replays simulated results only")
    return src


def _in_repo(path: str) -> str:
    from bench.bench_results import _in_repo as in_repo
    return in_repo(path)


def plan(args: argparse.Namespace, src: dict[str, Any]) -> dict[str, Any]:
    """What to replay: workload, cluster, homes, duration, seed and scale (checked; errors name the field)."""
    seeds = src.get("seeds") or [None]
    seed = seeds[0]
    per = src["per_seed"].get(str(seed)) or next(iter(src["per_seed"].values()), None)
    if per is None:
        raise ConfigError(args.source, "per_seed", "empty")
    scale = args.scale
    if scale is None:
        at = per["policies"].get(args.at)
        if at is None:
            raise ConfigError(args.source, "--at", f"{args.at!r} is not among its policies "
                                                   f"({', '.join(per['policies'])})")
        scale = at.get(f"max_scale_{args.bound}")
        if not scale:
            raise ConfigError(args.source, f"max_scale_{args.bound}", f"{args.at} has no boundary there")
    own = {}
    for name in [x.strip() for x in (args.own_boundary or "").split(",") if x.strip()]:
        v = (per["policies"].get(name) or {}).get(f"max_scale_{args.bound}")
        if not v:
            raise ConfigError(args.source, "--own-boundary", f"{name!r} has no ≤ {args.bound}% boundary there")
        own[name] = float(v)
    homes = (src.get("containers") or {}).get("homes")
    return {"workload": _in_repo(src["workload"]), "cluster": _in_repo(src["cluster"]), "homes": homes,
            "duration_s": src.get("duration_s"), "scale_mode": src.get("scale_mode"), "seed": seed,
            "scale": float(scale), "own": own}


def run_anatomy(args: argparse.Namespace) -> dict[str, Any]:
    from services.cli.simulate import load_workload_file, simulate
    from shared.policies import POLICIES
    src = _load_source(args.source)
    spec = plan(args, src)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in POLICIES or getattr(POLICIES.get(x), "analytic", False)]
    if bad or not policies:
        valid = [n for n in POLICIES.names() if not getattr(POLICIES.get(n), "analytic", False)]
        raise ConfigError("(arguments)", "--policies", f"{','.join(bad) or '(none)'}: unknown or analytic policy; "
                          f"valid: {', '.join(valid)}")
    cluster = load_cluster(spec["cluster"])
    todo = [(name, name, spec["scale"]) for name in policies]
    todo += [(f"{name} at its boundary", name, sc) for name, sc in spec["own"].items()]
    runs = {}
    for label, name, scale in todo:
        w = load_workload_file(spec["workload"], scale, spec["seed"], spec["duration_s"], spec["scale_mode"])
        t0 = time.perf_counter()
        chunks = name in (src.get("deadline_chunks") or ())  # each policy's prefill order in the source run
        cap = float((src.get("step_cap_s") or {}).get(name, 0.0))  # and its step cap
        r = simulate(cluster, w, name, seed=spec["seed"], containers=spec["homes"], anatomy_bin_s=args.bin_s,
                     deadline_chunks=chunks, step_cap_s=cap)
        runs[label] = {"policy": name, "scale": scale, "deadline_chunks": chunks, "step_cap_s": cap,
                       "tokens_per_s": r["tokens_per_s"],
                       "violation_rate": r["violation_rate"], "worst_tenant": r["total"].get("worst_tenant"),
                       "worst_tenant_violation_rate": r["total"].get("worst_tenant_violation_rate"),
                       "wall_s": round(time.perf_counter() - t0, 1), **r["anatomy"]}
        print(f"  {label:<28} scale {scale:8.3f}: violations {100 * r['violation_rate']:5.2f}% "
              f"({runs[label]['by_cause']})", file=sys.stderr, flush=True)
    return {"source": src["workload"], "from": args.source, "at": args.at, "bound": args.bound,
            "scale": spec["scale"], "seed": spec["seed"], "duration_s": spec["duration_s"], "runs": runs}


def command_line(args: argparse.Namespace) -> str:
    argv = ["slicesched", "bench", "anatomy", "--from", args.source]
    for flag, value, default in (("--policies", args.policies, "container,slice"), ("--bound", args.bound, "9"),
                                 ("--at", args.at, "slice"), ("--scale", args.scale, None),
                                 ("--own-boundary", args.own_boundary, "container"),
                                 ("--bin-s", args.bin_s, DEFAULT_BIN_S), ("--json", args.json_out, None)):
        if value != default:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    from bench.bench_results import _full_duration
    from bench.results.meta import run_meta
    t0 = time.perf_counter()
    try:
        res = run_anatomy(args)
    except ConfigError as e:
        print(f"slicesched bench anatomy: {e}", file=sys.stderr)
        return 2
    res["meta"] = run_meta("sim", command=command_line(args), results_command=command_line(args),
                           wall_s=time.perf_counter() - t0, quick=False, duration_s=res["duration_s"],
                           full_duration_s=_full_duration(_in_repo(res["source"])))
    text = json.dumps(res, indent=1) + "\n"
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text)
    else:
        print(text)
    return 0
