"""``slicesched bench compare``: max sustainable throughput per policy, side by side, on one workload.

Every policy starts from the same static partition: planned for the workload under the SLA on tuning seeds
(``--containers plan``, the default for the simulator: :mod:`services.cli.plan`), the tenants file's home devices,
average-work sizing, or a containers file. For each policy and each reporting arrival seed it searches the largest
rate scale at which the violation rate stays ≤ 9% and, separately, ≤ 1% — in aggregate **and** for every tenant with
at least 100 requests there (DESIGN §9) — by bracketing (doubling/halving) then bisection in log space, and
reports token throughput there, the worst tenant, the ratio to ``container`` and the share of ``pooled-bound``'s
gain, per seed and as the median over the seeds with their range. Fidelity levels are a table (``FIDELITIES``);
this module provides ``sim``, other levels register a runner the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

from loadgen.mix import SCALE_MODES
from shared.argtypes import name_list, name_seconds, nonneg_int, positive_float, positive_int, seed_list
from shared.config import ConfigError, load_cluster
from bench.compare_search import CHILDREN, _Search, _Turns, passes  # noqa: F401  (CHILDREN, passes: re-exported)
from bench.compare_summary import BOUNDS, captured, median_of, median_policies, ratios  # noqa: F401
from shared.sim.metrics import MIN_TENANT_REQUESTS

TUNING_SEEDS = (101, 102)  # arrival seeds the partition is planned on; never reported
MODES = ("plan", "homes", "sized")  # --containers other than a file
PLANNED_FOR = "container"  # the policy a planned partition is sized for (its engine setting plans it)

# fidelity -> "module:function"; the function runs one point: (args, policy, scale, seed=..., stop_above=...) ->
# result dict with at least tokens_per_s and violation_rate (and, where known, worst_tenant_violation_rate, tenants).
# ``seed`` is the arrival seed (None: the file's); ``stop_above`` lets a point stop once it is known to violate more
# than that bound (it then carries ``stopped_early``). Other fidelity levels add their entry here.
FIDELITIES: dict[str, str] = {"sim": "bench.bench_compare:run_sim_point",
                              "emulated": "bench.compare_mesh:run_emulated_point",
                              "real": "bench.compare_mesh:run_real_point"}
SERIAL_FIDELITIES = {"emulated", "real"}  # one mesh at a time on this machine; the policies' points alternate
STEERING = ("on", "off", "both")  # --sim-steering; "both" searches <policy>/steering-on and <policy>/steering-off


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--policies", default="container,container-realloc,muxserve,token-pool,slice,pooled-bound")
    p.add_argument("--fidelity", default="sim", help=f"one of: {', '.join(FIDELITIES)}")
    p.add_argument("--seeds", type=seed_list, default=None,
                   help="reporting arrival seeds, e.g. 1,2,3: each policy is searched on each, the result is the "
                        "median with its range (default: the workload file's seed)")
    p.add_argument("--seed", type=nonneg_int, default=None, help="one reporting seed (same as --seeds N)")
    p.add_argument("--tuning-seeds", type=seed_list, default=TUNING_SEEDS,
                   help="arrival seeds the partition is planned on with --containers plan (default "
                        f"{','.join(map(str, TUNING_SEEDS))}; must differ from the reporting seeds)")
    p.add_argument("--duration-s", type=positive_float, default=None, help="replay only the first D seconds")
    p.add_argument("--plan-duration-s", type=positive_float, default=None,
                   help="plan on the first D seconds (default: --duration-s)")
    p.add_argument("--scale-mode", choices=SCALE_MODES, default=None,
                   help="how load is scaled: superpose (more users; the workload files' default) or compress")
    p.add_argument("--start-scale", type=positive_float, default=4.0)
    p.add_argument("--tolerance", type=positive_float, default=0.04, help="stop when hi/lo < 1 + tolerance")
    p.add_argument("--max-scale", type=positive_float, default=256.0)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="searches run in parallel (>1: each point in its own process)")
    p.add_argument("--containers", default=None, metavar="plan|homes|sized|FILE",
                   help="the partition every policy starts from: plan (planned on the tuning seeds; the sim "
                        "default), homes (the tenants file's; the meshes' default), sized (by average work) or a "
                        "containers file")
    p.add_argument("--confirm", type=int, default=None,
                   help="passes a reported point needs (replays until then; default 2 on the meshes, real and "
                        "emulated, 1 in the simulator)")
    p.add_argument("--sim-steering", choices=STEERING, default=None,
                   help="mesh fidelities: the scheduler's what-if with the simulator service's learned corrections "
                        "and forecasts (on), without (off, SLICESCHED_SIM_STEERING=0), or each policy searched both "
                        "ways, their points alternating (both: policies named <policy>/steering-on and "
                        "<policy>/steering-off); default: as the environment says")
    p.add_argument("--lane-handback", choices=("on", "off"), default=None,
                   help="the policies that take it (slice) run with lane_handback true (on) or false (off): guest "
                        "lanes hand each prefilled sequence to the home device (docs/guest-execution.md); every "
                        "fidelity; default: the policy's own setting (on)")
    p.add_argument("--deadline-chunks", type=name_list, default=(), metavar="POLICY[,POLICY...]",
                   help="these policies run with deadline-aware chunked prefill (a prefill chunk goes to the "
                        "waiting prompt whose first-token deadline comes first; docs/simulator.md), the others in "
                        "arrival order: the simulator's --deadline-chunks, the meshes' SLICESCHED_DEADLINE_CHUNKS. "
                        "With container among them the partition is also planned with it")
    p.add_argument("--step-cap", type=name_seconds, default={}, metavar="POLICY=S[,POLICY=S...]",
                   help="these policies' engines cap each step at S seconds while sequences decode (TPOT-bounded "
                        "chunked prefill: prefill tokens only while the step's predicted time stays within S; "
                        "docs/simulator.md): the simulator's --step-cap-s, the meshes' SLICESCHED_STEP_CAP_S. With "
                        "container among them the partition is also planned with its cap")
    p.add_argument("--reuse", action="append", default=[], metavar="POLICY=FILE",
                   help="take POLICY's searches from an earlier compare JSON instead of running them again (repeat "
                        "per policy); FILE must have the same workload, cluster, fidelity, seeds, duration, scale "
                        "mode and search settings, and its partition is used for every policy. Only for a policy "
                        "whose code has not changed since FILE was written (e.g. the baseline while tuning slice)")
    p.add_argument("--json", dest="json_out", default=None)


def point_summary(r: dict[str, Any]) -> dict[str, Any]:
    """What a search keeps of one simulator or mesh result."""
    tenants = {name: {"requests": t["requests"], "violation_rate": round(t["violation_rate"], 5),
                      "by_cause": t.get("violations_by_cause")} for name, t in (r.get("tenants") or {}).items()}
    counted = [(v["violation_rate"], n) for n, v in tenants.items() if v["requests"] >= MIN_TENANT_REQUESTS]
    worst = max(counted) if counted else (0.0, None)
    out = {k: r[k] for k in ("tokens_per_s", "violation_rate", "events", "wall_s", "leases", "cpu_s",
                             "stopped_early", "steering") if k in r}
    out.update(worst_tenant=worst[1], worst_tenant_violation_rate=worst[0], tenants=tenants)
    for k in ("device_utilization_mean", "device_busy_mean", "device_s_per_1k_tokens"):
        if k in r.get("total", {}):
            out[k] = r["total"][k]
    return out


def run_sim_point(args: argparse.Namespace, policy: str, scale: float, seed: int | None = None,
                  stop_above: float | None = None) -> dict[str, Any]:
    """One simulator run: in this process with ``--jobs 1``, else in a subprocess (JSON out) so that several
    points use several cores."""
    homes = getattr(args, "homes", None)
    if args.jobs <= 1:
        from services.cli.simulate import load_workload_file, simulate
        w = load_workload_file(args.workload, scale, seed, args.duration_s, getattr(args, "scale_mode", None))
        r = simulate(_cluster(args.cluster), w, policy, point_params(args, policy), seed=seed, containers=homes,
                     stop_above=stop_above, deadline_chunks=chunks_for(args, policy),
                     step_cap_s=cap_for(args, policy))
        return point_summary(r)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "services.cli.main", "simulate", "--cluster", args.cluster, "--workload",
               args.workload, "--policy", policy, "--rate-scale", repr(scale), "--json", str(out), "--progress", "off"]
        if homes is not None:
            from shared.containers import write_containers
            write_containers(Path(tmp) / "containers.yaml", homes)
            cmd += ["--containers", str(Path(tmp) / "containers.yaml")]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        if args.duration_s is not None:
            cmd += ["--duration-s", repr(args.duration_s)]
        if getattr(args, "scale_mode", None):
            cmd += ["--scale-mode", args.scale_mode]
        if stop_above is not None:
            cmd += ["--stop-above", repr(stop_above)]
        if chunks_for(args, policy):
            cmd += ["--deadline-chunks"]
        if cap_for(args, policy):
            cmd += ["--step-cap-s", repr(cap_for(args, policy))]
        cmd += [f"--param={k}={str(v).lower()}" for k, v in point_params(args, policy).items()]
        p = CHILDREN.run(cmd, Path(__file__).resolve().parents[1])
        if p.returncode != 0:
            raise RuntimeError(f"simulate {policy} at scale {scale} failed: {p.stderr.strip()[-500:]}")
        return point_summary(json.loads(out.read_text()))


def containers_mode(args: argparse.Namespace) -> str:
    """The partition a run uses: ``--containers``, else ``plan`` on the simulator and ``homes`` on the meshes."""
    c = getattr(args, "containers", None)
    return c or ("plan" if getattr(args, "fidelity", "sim") == "sim" else "homes")


def resolve_containers(args: argparse.Namespace) -> tuple[dict[str, list[str]] | None, dict[str, Any]]:
    """(homes for every policy — None for the tenants file's —, a description for the result JSON). ``plan``
    plans on the tuning seeds with the simulator (also for the meshes: their cluster modelled)."""
    if isinstance(getattr(args, "containers", None), Mapping):  # already resolved (e.g. a mesh and its prediction)
        c = dict(args.containers)
        return c.get("homes"), c
    mode = containers_mode(args)
    if mode == "homes":
        return None, {"mode": "homes"}
    from services.cli.simulate import homes_for, load_workload_file
    cluster = load_cluster(args.cluster)
    if mode == "plan":
        from services.cli.plan import homes_of, plan_for
        dur = getattr(args, "plan_duration_s", None) or args.duration_s
        t0 = time.perf_counter()
        print(f"  planning containers on seeds {','.join(map(str, args.tuning_seeds))} ...", file=sys.stderr,
              flush=True)
        chunks, cap = chunks_for(args, PLANNED_FOR), cap_for(args, PLANNED_FOR)
        _, plan = plan_for(args.workload, args.cluster, tuple(args.tuning_seeds), BOUNDS["9"], dur,
                           getattr(args, "scale_mode", None), deadline_chunks=chunks, step_cap_s=cap)
        homes = homes_of(cluster, plan.counts)
        return homes, {"mode": "plan", "homes": homes, "devices": plan.counts, "tuning_seeds": list(plan.seeds),
                       "planned_scale": plan.max_scale, "bound": plan.bound, "duration_s": dur,
                       "deadline_chunks": chunks, **({"step_cap_s": cap} if cap else {}),
                       "simulations": plan.simulations,
                       "wall_s": round(time.perf_counter() - t0, 1)}
    w = load_workload_file(args.workload, 1.0, None, args.duration_s)
    h = homes_for(mode, cluster, w)
    homes = {t: list(ds) for t, ds in h.items()} if h is not None else None
    return homes, {"mode": "sized" if mode == "sized" else "file", "file": None if mode == "sized" else mode,
                   "homes": homes}


_CLUSTERS: dict[str, Any] = {}


def _cluster(path: str):
    if path not in _CLUSTERS:
        _CLUSTERS[path] = load_cluster(path)
    return _CLUSTERS[path]


def _runner(fidelity: str) -> Callable[..., dict[str, Any]]:
    import importlib
    mod, fn = FIDELITIES[fidelity].split(":")
    return getattr(importlib.import_module(mod), fn)


def confirm_of(args: argparse.Namespace) -> int:
    """Passes a reported point needs: ``--confirm``, by default 2 on the meshes (their single 60-s points move by
    ± 5-10 points of violations between replays, the emulated one's too) and 1 in the simulator (deterministic)."""
    c = getattr(args, "confirm", None)
    return int(c) if c is not None else (2 if getattr(args, "fidelity", "sim") in SERIAL_FIDELITIES else 1)


def seeds_of(args: argparse.Namespace) -> list[int | None]:
    """Reporting seeds: ``--seeds``, else ``--seed``, else the workload file's own (None)."""
    seeds = getattr(args, "seeds", None)
    if seeds:
        return list(seeds)
    return [getattr(args, "seed", None)]


def _boundary(scale: float, r: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """The per-bound fields of one search's answer."""
    return {f"max_scale_{key}": scale, f"tokens_per_s_{key}": r["tokens_per_s"] if r else 0.0,
            f"violation_rate_{key}": r["violation_rate"] if r else None,
            f"worst_tenant_{key}": r.get("worst_tenant") if r else None,
            f"worst_tenant_violation_rate_{key}": r.get("worst_tenant_violation_rate") if r else None,
            f"tenants_{key}": r.get("tenants") if r else None}


def compare(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    point = _runner(args.fidelity)
    lock = threading.Lock()
    log: list[dict[str, Any]] = []
    serial = args.fidelity in SERIAL_FIDELITIES
    seeds = seeds_of(args)
    reused = reused_searches(args, policies)
    tasks = [(seed, p) for seed in seeds for p in policies if (seed, p) not in reused]
    turns = _Turns([f"{s}:{p}" for s, p in tasks]) if serial else None
    t0 = time.perf_counter()
    homes, containers = resolve_containers(args)
    args.homes = homes

    def search(task: tuple[int | None, str]) -> tuple[tuple[int | None, str], dict[str, Any]]:
        try:
            return task, one_search(*task)
        finally:
            if turns is not None:
                turns.leave(f"{task[0]}:{task[1]}")

    def one_search(seed: int | None, policy: str) -> dict[str, Any]:
        def at(scale: float, bound: float) -> dict[str, Any]:
            if CHILDREN.stopping.is_set():
                raise RuntimeError("comparison interrupted")
            run = lambda: point(args, policy, scale, seed=seed, stop_above=bound)  # noqa: E731
            r = turns.run(f"{seed}:{policy}", run) if turns else run()
            with lock:
                log.append({"policy": policy, "seed": seed, "scale": scale,
                            **{k: r[k] for k in ("tokens_per_s", "violation_rate", "worst_tenant_violation_rate",
                                                 "stopped_early", "wall_s", "cpu_s", "steering") if k in r}})
                stop = " (stopped early)" if r.get("stopped_early") else ""
                print(f"  {policy:18s} seed {seed} scale {scale:8.3f}: violations {r['violation_rate'] * 100:6.2f}% "
                      f"(worst tenant {100 * (r.get('worst_tenant_violation_rate') or 0):6.2f}%)  "
                      f"{r['tokens_per_s']:10.1f} tok/s{stop}", file=sys.stderr, flush=True)
            return r
        s = _Search(policy, at, args, confirm_of(args))
        out: dict[str, Any] = {}
        for key, (scale, r) in s.boundaries(BOUNDS).items():
            out.update(_boundary(scale, r, key))
            if key == "9":
                out["violation_rate"] = r["violation_rate"] if r else None
                out["leases"] = r.get("leases") if r else None
        return out

    jobs = max(1, len(tasks)) if serial else max(1, args.jobs)  # serial: one thread per search, turns keep one point
    CHILDREN.stopping.clear()
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        try:
            results = dict(ex.map(search, tasks))
        except BaseException:  # an interrupt or a failed point: stop the other searches' points too
            CHILDREN.stop()
            raise
    for (seed, p), (r, runs) in reused.items():
        results[(seed, p)] = r
        log.extend(runs)
    per_seed = {}
    for seed in seeds:
        pol = {p: results[(seed, p)] for p in policies}
        per_seed[str(seed)] = {"policies": pol, "ratio_to_container": ratios(pol),
                               "pooled_gain_captured": captured(pol)}
    res: dict[str, Any] = {"policies": median_policies(per_seed, policies), "fidelity": args.fidelity,
                           "workload": args.workload, "cluster": args.cluster, "seeds": seeds,
                           "tuning_seeds": containers.get("tuning_seeds"),
                           "duration_s": args.duration_s, "scale_mode": getattr(args, "scale_mode", None),
                           "containers": containers, "confirm": confirm_of(args),
                           "sim_steering": getattr(args, "sim_steering", None), "search": search_settings(args),
                           "wall_s": time.perf_counter() - t0, "per_seed": per_seed}
    if reused:
        res["reused"] = {p: f for p, f in (r.split("=", 1) for r in args.reuse)}
    if getattr(args, "deadline_chunks", None):
        res["deadline_chunks"] = sorted({p.split("/")[0] for p in policies if chunks_for(args, p)})
    if getattr(args, "step_cap", None):
        res["step_cap_s"] = {p.split("/")[0]: cap_for(args, p) for p in policies if cap_for(args, p)}
    if getattr(args, "lane_handback", None):
        res["lane_handback"] = {p: args.lane_handback for p in policies if handback_params(args, p)}
    res["ratio_to_container"] = median_of(per_seed, "ratio_to_container")
    res["pooled_gain_captured"] = median_of(per_seed, "pooled_gain_captured")
    res["runs"] = sorted(log, key=lambda x: (x["policy"], str(x["seed"]), x["scale"]))
    return res


def search_settings(args: argparse.Namespace) -> dict[str, float]:
    """What decides which points a search visits (kept in the JSON so that ``--reuse`` can check it)."""
    return {k: getattr(args, k, None) for k in ("start_scale", "tolerance", "max_scale")}


_SAME = ("workload", "cluster", "fidelity", "duration_s", "scale_mode")


class ReuseError(ValueError):
    """A ``--reuse POLICY=FILE`` that cannot be honoured; the message names the option and what differs."""


def reused_searches(args: argparse.Namespace,
                    policies: list[str]) -> dict[tuple[int | None, str], tuple[dict[str, Any], list[dict[str, Any]]]]:
    """``(seed, policy) -> (search result, its logged points)`` taken from ``--reuse POLICY=FILE``. The earlier
    run must match this one on every setting that decides a search's answer; its partition (``containers``)
    becomes this run's, so a planned partition is not planned again."""
    out: dict[tuple[int | None, str], tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    mode = containers_mode(args) if not isinstance(getattr(args, "containers", None), Mapping) else None
    for spec in getattr(args, "reuse", None) or []:
        policy, sep, path = spec.partition("=")
        if not sep or not policy or not path:
            raise ReuseError(f"--reuse {spec!r}: expected POLICY=FILE")
        if policy not in policies:
            raise ReuseError(f"--reuse {spec!r}: {policy} is not among --policies ({', '.join(policies)})")
        try:
            prev = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ReuseError(f"--reuse {spec!r}: cannot read {path}: {e}") from None
        for k in _SAME:
            if prev.get(k) != getattr(args, k, None):
                raise ReuseError(f"--reuse {spec!r}: {k} differs ({prev.get(k)!r} there, {getattr(args, k, None)!r}"
                                 " here)")
        mine = search_settings(args)
        for k, v in (prev.get("search") or {}).items():
            if v != mine.get(k):
                raise ReuseError(f"--reuse {spec!r}: --{k.replace('_', '-')} differs ({v!r} there, {mine[k]!r} here)")
        c = prev.get("containers") or {}
        if mode in MODES and c.get("mode") != mode:
            raise ReuseError(f"--reuse {spec!r}: --containers differs ({c.get('mode')!r} there, {mode!r} here)")
        if mode is not None and mode not in MODES and file_homes(args, mode) != c.get("homes"):
            raise ReuseError(f"--reuse {spec!r}: --containers {mode} gives other devices than the partition there")
        was, now = policy in (prev.get("deadline_chunks") or ()), chunks_for(args, policy)
        if was != now:
            raise ReuseError(f"--reuse {spec!r}: {policy} ran {'with' if was else 'without'} --deadline-chunks there,"
                             f" {'with' if now else 'without'} here")
        was, now = (prev.get("step_cap_s") or {}).get(policy, 0.0), cap_for(args, policy)
        if was != now:
            raise ReuseError(f"--reuse {spec!r}: {policy} ran with a step cap of {was:g} s there, {now:g} s here "
                             "(0: none)")
        if mode == "plan" and c.get("step_cap_s", 0.0) != cap_for(args, PLANNED_FOR):
            raise ReuseError(f"--reuse {spec!r}: the partition was planned with a step cap of "
                             f"{c.get('step_cap_s', 0.0):g} s ({PLANNED_FOR}'s --step-cap decides)")
        if mode == "plan" and bool(c.get("deadline_chunks")) != chunks_for(args, PLANNED_FOR):
            how = "with" if c.get("deadline_chunks") else "without"
            raise ReuseError(f"--reuse {spec!r}: the partition was planned {how} deadline-aware chunks "
                             f"({PLANNED_FOR} in --deadline-chunks decides)")
        if mode == "plan":
            dur = getattr(args, "plan_duration_s", None) or args.duration_s
            if c.get("tuning_seeds") != list(args.tuning_seeds) or c.get("duration_s") != dur:
                raise ReuseError(f"--reuse {spec!r}: the partition was planned on seeds {c.get('tuning_seeds')} over "
                                 f"{c.get('duration_s')} s, this run plans on {list(args.tuning_seeds)} over {dur} s")
        if isinstance(getattr(args, "containers", None), Mapping) and args.containers.get("homes") != c.get("homes"):
            raise ReuseError(f"--reuse {spec!r}: its partition differs from another --reuse file's")
        if mode is not None:  # the first file: its partition (with how it was made), the containers file named
            args.containers = c if mode in MODES else dict(c, file=mode)
        for seed in seeds_of(args):
            r = (prev.get("per_seed") or {}).get(str(seed), {}).get("policies", {}).get(policy)
            if r is None:
                raise ReuseError(f"--reuse {spec!r}: no {policy} search on seed {seed} there")
            runs = [x for x in prev.get("runs", []) if x.get("policy") == policy and x.get("seed") == seed]
            out[(seed, policy)] = (r, runs)
    return out


def file_homes(args: argparse.Namespace, path: str) -> dict[str, list[str]]:
    """The devices per tenant of the containers file ``path`` (as a JSON result records them)."""
    from services.cli.simulate import homes_for, load_workload_file
    w = load_workload_file(args.workload, 1.0, None, 1.0)
    return {t: list(ds) for t, ds in (homes_for(path, _cluster(args.cluster), w) or {}).items()}


def point_params(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Parameters a simulated point gives ``policy`` over the cluster file's: ``args.policy_params[policy]`` (set
    by ``bench tune`` for each candidate) and ``--lane-handback``."""
    return {**(getattr(args, "policy_params", None) or {}).get(policy, {}), **handback_params(args, policy)}


def chunks_for(args: argparse.Namespace, policy: str) -> bool:
    """Whether ``policy`` (or its ``/steering-*`` variant) runs with deadline-aware chunked prefill
    (``--deadline-chunks``)."""
    return policy.split("/")[0] in (getattr(args, "deadline_chunks", None) or ())


def cap_for(args: argparse.Namespace, policy: str) -> float:
    """The step cap in seconds ``policy`` (or its ``/steering-*`` variant) runs with (``--step-cap``; 0: none)."""
    return float((getattr(args, "step_cap", None) or {}).get(policy.split("/")[0], 0.0))


def check_engine_options(args: argparse.Namespace, policies: list[str]) -> str | None:
    """Why ``--deadline-chunks`` or ``--step-cap`` cannot be honoured for ``policies`` (None when they can)."""
    from shared.policies import POLICIES
    names = {p.split("/")[0] for p in policies}
    for flag, named in (("--deadline-chunks", getattr(args, "deadline_chunks", None) or ()),
                        ("--step-cap", getattr(args, "step_cap", None) or {})):
        for name in named:
            if name not in names:
                return f"{flag}: {name} is not among --policies ({', '.join(policies)})"
            if getattr(POLICIES.get(name), "analytic", False):
                return f"{flag}: {name} is an analytic bound with no engine to chunk prefill in"
    return None


def handback_params(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """``{"lane_handback": on?}`` for a policy that takes it when ``--lane-handback on|off`` is given, else ``{}``."""
    import dataclasses

    from shared.policies import POLICIES
    if not getattr(args, "lane_handback", None) or policy.split("/")[0] not in POLICIES:
        return {}
    cls = POLICIES.get(policy.split("/")[0])
    cfg = getattr(cls, "config_cls", None)
    takes = cfg is not None and any(f.name == "lane_handback" for f in dataclasses.fields(cfg))
    return {"lane_handback": args.lane_handback == "on"} if takes else {}


def _usage(msg: str) -> int:
    print(f"slicesched bench compare: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from shared.policies import POLICIES
    if args.fidelity not in FIDELITIES:
        return _usage(f"unknown fidelity {args.fidelity!r}; valid: {', '.join(FIDELITIES)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        return _usage(f"unknown policy {', '.join(bad) or '(none)'}; valid: {', '.join(POLICIES.names())}")
    steering = getattr(args, "sim_steering", None)
    if steering and args.fidelity == "sim":
        return _usage("--sim-steering is for the mesh fidelities (the simulator service steers a live scheduler)")
    if getattr(args, "lane_handback", None) and not any(handback_params(args, p) for p in policies):
        return _usage(f"--lane-handback: none of {', '.join(policies)} takes lane_handback (slice does)")
    why = check_engine_options(args, policies)
    if why:
        return _usage(why)
    if steering == "both":
        policies = [f"{p}/steering-{v}" for p in policies for v in ("on", "off")]
    if args.confirm is not None and args.confirm < 1:
        return _usage(f"--confirm must be at least 1 (got {args.confirm})")
    if args.seeds and args.seed is not None:
        return _usage("give --seeds or --seed, not both")
    mode = containers_mode(args)
    if args.fidelity != "sim" and mode == "sized":
        return _usage(f"--containers sized is for --fidelity sim; the {args.fidelity} mesh runs the tenants "
                      "file's home devices, a containers file or a plan")
    if args.fidelity != "sim" and (len(seeds_of(args)) > 1 or seeds_of(args)[0] is not None):
        return _usage(f"--seeds is for --fidelity sim; the {args.fidelity} mesh replays the workload file's seed")
    if mode == "plan" and set(args.tuning_seeds) & {s for s in seeds_of(args) if s is not None}:
        return _usage("the tuning seeds must differ from the reporting seeds (--tuning-seeds, --seeds)")
    load_cluster(args.cluster)
    if not Path(args.workload).is_file():
        raise ConfigError(args.workload, "(file)", "workload file not found")
    if mode not in MODES and not Path(mode).is_file():
        raise ConfigError(mode, "(file)", "containers file not found")
    try:
        res = compare(args, policies)
    except ReuseError as e:
        return _usage(str(e))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    print_table(res)
    return 0


def print_table(res: dict[str, Any]) -> None:
    """The comparison as a table: medians over the seeds (range in brackets when there are several)."""
    rat = res["ratio_to_container"]
    many = len(res["seeds"]) > 1
    print(f"seeds {','.join(map(str, res['seeds']))}; containers: {res['containers']['mode']}" +
          (f" (planned on seeds {','.join(map(str, res['tuning_seeds']))})" if res.get("tuning_seeds") else ""))
    if res.get("deadline_chunks"):
        print(f"deadline-aware chunked prefill: {', '.join(res['deadline_chunks'])} (the others: arrival order)")
    if res.get("step_cap_s"):
        print("TPOT-bounded chunked prefill (step cap): " +
              ", ".join(f"{p} {s:g} s" for p, s in res["step_cap_s"].items()) + " (the others: no cap)")
    print(f"{'policy':18s} {'scale@9%':>9s} {'tok/s@9%':>10s} {'x cont.':>14s} {'worst tenant':>12s} "
          f"{'scale@1%':>9s} {'tok/s@1%':>10s}")
    for name, r in res["policies"].items():
        x = rat.get(name, {})
        xs = f"{x['9']:.2f}" if x.get("9") else "-"
        if many and x.get("9_range"):
            xs += f" [{x['9_range'][0]:.2f}-{x['9_range'][1]:.2f}]"
        w = r.get("worst_tenant_violation_rate_9")
        print(f"{name:18s} {r['max_scale_9'] or 0:9.3f} {r['tokens_per_s_9'] or 0:10.1f} {xs:>14s} "
              f"{(f'{w * 100:.1f}%' if w is not None else '-'):>12s} {r['max_scale_1'] or 0:9.3f} "
              f"{r['tokens_per_s_1'] or 0:10.1f}")
    if res["pooled_gain_captured"]:
        print("share of pooled-bound's gain captured (9%, median):",
              {k: (round(v['9'], 3) if v['9'] is not None else None) for k, v in res["pooled_gain_captured"].items()})
