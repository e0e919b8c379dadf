"""``slicesched bench tune``: tune a policy's parameters on arrival seeds that are never reported.

A baseline is only as fair as its parameters. For every candidate of a grid (``--grid KEY=V1,V2 ...``, the cartesian
product) this searches, on each workload and each tuning seed, the largest rate scale the policy sustains within the
bound (the same search and rule as ``bench compare``: aggregate and every tenant with ≥ 100 requests), from the same
planned partition ``bench compare`` would give every policy (planned on the same tuning seeds), and ranks the
candidates by the geometric mean over workloads of their median scale over the seeds. ``container`` is searched on
the same points as the yardstick (``× container``), prefilling in arrival order. The grid key ``deadline_chunks``
(true/false) is the engine's prefill order for the tuned policy (as ``bench compare --deadline-chunks``) and
``step_cap_s`` (seconds, 0 = none) its step cap (as ``bench compare --step-cap``), not policy parameters; the partition
is planned in arrival order and uncapped either way. The winner goes into the cluster file's
``policies.<name>`` by hand, with the command in a comment: ``bench compare`` and the live scheduler read it there.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shared.argtypes import positive_float, positive_int, seed_list
from shared.config import ConfigError, load_cluster

REFERENCE = "container"
ENGINE_KEYS = ("deadline_chunks", "step_cap_s")  # grid keys that set the engine a policy runs on, not its parameters


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", required=True, help="the policy to tune (a registered name)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="candidate values of one parameter (repeat; the candidates are the cartesian product)")
    p.add_argument("--workloads", required=True, help="comma-separated workload files")
    p.add_argument("--cluster", required=True)
    p.add_argument("--seeds", type=seed_list, default=(101, 102),
                   help="tuning arrival seeds: the partition is planned and every candidate searched on these "
                        "(default 101,102: never reported by bench compare / bench results)")
    p.add_argument("--containers", default="plan", metavar="plan|homes|sized|FILE",
                   help="the partition, as bench compare's --containers (default: plan)")
    p.add_argument("--duration-s", type=positive_float, default=None, help="replay only the first D seconds")
    p.add_argument("--plan-duration-s", type=positive_float, default=None,
                   help="plan on the first D seconds (default: --duration-s)")
    p.add_argument("--bound", choices=("9", "1"), default="9", help="violation bound in %% (default 9)")
    p.add_argument("--start-scale", type=positive_float, default=16.0)
    p.add_argument("--tolerance", type=positive_float, default=0.08)
    p.add_argument("--max-scale", type=positive_float, default=256.0)
    p.add_argument("--jobs", type=positive_int, default=1, help="searches in parallel (>1: a process per point)")
    p.add_argument("--json", dest="json_out", default=None)


def candidates(policy: str, grid: list[str]) -> list[dict[str, Any]]:
    """The cartesian product of ``--grid`` items, each checked by building the policy (a bad key or value raises
    :class:`ConfigError` naming ``--grid``)."""
    from services.cli.simulate import parse_params
    from shared.policies import POLICIES, PolicyConfigError, make_policy
    if policy not in POLICIES:
        raise ConfigError("--policy", policy, f"unknown policy; valid: {', '.join(sorted(POLICIES.names()))}")
    axes: list[tuple[str, list[Any]]] = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not key or not values or any(not v for v in values.split(",")):
            raise ConfigError("--grid", item, "expected KEY=V1,V2,...")
        if key in dict(axes):
            raise ConfigError("--grid", item, f"{key!r} given twice")
        axes.append((key, [parse_params([f"{key}={v}"])[key] for v in values.split(",")]))
    out = [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[vs for _, vs in axes])]
    for params in out:
        if "deadline_chunks" in params and not isinstance(params["deadline_chunks"], bool):
            raise ConfigError("--grid", f"deadline_chunks={params['deadline_chunks']}", "expected true or false")
        cap = params.get("step_cap_s", 0)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= cap < math.inf:
            raise ConfigError("--grid", f"step_cap_s={cap}", "expected seconds, a number >= 0 (0: no cap)")
        try:
            make_policy(policy, policy_part(params))
        except (PolicyConfigError, TypeError, ValueError) as e:
            raise ConfigError("--grid", ",".join(f"{k}={v}" for k, v in params.items()), str(e)) from None
    return out


def policy_part(params: dict[str, Any]) -> dict[str, Any]:
    """A candidate's policy parameters (without the engine keys)."""
    return {k: v for k, v in params.items() if k not in ENGINE_KEYS}


def _label(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "(cluster file's)"


def _ns(args: argparse.Namespace, workload: str) -> argparse.Namespace:
    return argparse.Namespace(workload=workload, cluster=args.cluster, fidelity="sim", duration_s=args.duration_s,
                              plan_duration_s=args.plan_duration_s, scale_mode=None, start_scale=args.start_scale,
                              tolerance=args.tolerance, max_scale=args.max_scale, jobs=args.jobs,
                              containers=args.containers, tuning_seeds=tuple(args.seeds), lane_handback=None,
                              policy_params={})


def search_one(ns: argparse.Namespace, policy: str, params: dict[str, Any], seed: int, bound: float
               ) -> tuple[float, dict[str, Any] | None]:
    """The largest scale ``policy`` with ``params`` sustains within ``bound`` on one workload and seed."""
    from bench.bench_compare import run_sim_point
    from bench.compare_search import CHILDREN, _Search
    mine = argparse.Namespace(**{**vars(ns), "policy_params": {policy: policy_part(params)},
                                 "deadline_chunks": (policy,) if params.get("deadline_chunks") else (),
                                 "step_cap": {policy: float(params["step_cap_s"])} if params.get("step_cap_s") else {}})

    def at(scale: float, b: float) -> dict[str, Any]:
        if CHILDREN.stopping.is_set():
            raise RuntimeError("tuning interrupted")
        r = run_sim_point(mine, policy, scale, seed=seed, stop_above=b)
        print(f"  {Path(ns.workload).stem:20s} {policy} [{_label(params)}] seed {seed} scale {scale:8.3f}: "
              f"violations {100 * r['violation_rate']:6.2f}% (worst tenant "
              f"{100 * (r.get('worst_tenant_violation_rate') or 0):6.2f}%)", file=sys.stderr, flush=True)
        return r
    return _Search(policy, at, mine, 1).max_scale(bound)


def tune(args: argparse.Namespace) -> dict[str, Any]:
    from bench.bench_compare import resolve_containers
    from bench.compare_search import CHILDREN
    from bench.compare_summary import BOUNDS
    from shared.policies import PolicyConfigError
    cands = candidates(args.policy, args.grid)
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads:
        raise ConfigError("--workloads", args.workloads, "expected one or more workload files")
    for w in workloads:
        if not Path(w).is_file():
            raise ConfigError("--workloads", w, "no such file")
    load_cluster(args.cluster)
    bound = BOUNDS[args.bound]
    t0 = time.perf_counter()
    nss, partitions = {}, {}
    for w in workloads:
        ns = _ns(args, w)
        ns.homes, partitions[w] = resolve_containers(ns)
        nss[w] = ns
    runs = [(w, REFERENCE, -1, {}) for w in workloads] + \
        [(w, args.policy, i, c) for w in workloads for i, c in enumerate(cands)]
    tasks = [(r, seed) for r in runs for seed in args.seeds]

    def one(task):
        (w, policy, i, params), seed = task
        try:
            return task, search_one(nss[w], policy, params, seed, bound)[0], None
        except (PolicyConfigError, RuntimeError) as e:  # a candidate that cannot run here sustains nothing
            if policy == REFERENCE or CHILDREN.stopping.is_set():
                raise
            return task, 0.0, str(e).strip().splitlines()[-1]

    CHILDREN.stopping.clear()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        try:
            found = list(ex.map(one, tasks))
        except BaseException:  # an interrupt or a failed reference: stop the other searches' points too
            CHILDREN.stop()
            raise
    scales: dict[tuple[str, int], dict[int, float]] = {}
    errors: dict[int, str] = {}
    for ((w, _, i, _), seed), scale, err in found:
        scales.setdefault((w, i), {})[seed] = scale
        if err:
            errors.setdefault(i, err)
    ref = {w: statistics.median(scales[(w, -1)].values()) for w in workloads}
    rows = []
    for i, params in enumerate(cands):
        med = {w: statistics.median(scales[(w, i)].values()) for w in workloads}
        x = {w: med[w] / ref[w] if ref[w] > 0 else None for w in workloads}
        score = math.exp(statistics.fmean(math.log(max(v, 1e-3)) for v in med.values()))
        rows.append({"params": params, "score": score, "max_scale": med, "x_container": x,
                     "per_seed": {w: {str(s): v for s, v in scales[(w, i)].items()} for w in workloads},
                     "error": errors.get(i)})
    rows.sort(key=lambda r: -r["score"])
    return {"policy": args.policy, "bound": args.bound, "seeds": list(args.seeds), "workloads": workloads,
            "cluster": args.cluster, "duration_s": args.duration_s, "plan_duration_s": args.plan_duration_s,
            "containers": {w: {k: v for k, v in p.items() if k != "homes"} for w, p in partitions.items()},
            "reference": {"policy": REFERENCE, "max_scale": ref}, "candidates": rows, "best": rows[0]["params"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def print_table(res: dict[str, Any]) -> None:
    ws = res["workloads"]
    print(f"{res['policy']} tuned on seeds {','.join(map(str, res['seeds']))} at ≤ {res['bound']}% "
          f"(median max scale over the seeds; × {REFERENCE} on the same points)")
    head = " | ".join(Path(w).stem for w in ws)
    print(f"| candidate | {head} | geo-mean scale |")
    print("|---|" + "---:|" * (len(ws) + 1))
    print(f"| {REFERENCE} | " + " | ".join(f"{res['reference']['max_scale'][w]:.3g}" for w in ws) + " | – |")
    for r in res["candidates"]:
        cells = [f"{r['max_scale'][w]:.3g} ({r['x_container'][w]:.2f}×)" if r["x_container"][w] is not None
                 else f"{r['max_scale'][w]:.3g}" for w in ws]
        print(f"| {_label(r['params'])} | " + " | ".join(cells) + f" | {r['score']:.3g} |"
              + (f" cannot run: {r['error']}" if r.get("error") else ""))
    print(f"best: {_label(res['best'])}")


def run(args: argparse.Namespace) -> int:
    res = tune(args)
    print_table(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    return 0
