"""``slicesched bench compare``: max sustainable throughput per policy, side by side, on one workload.

For each policy it searches the largest arrival-rate scale whose SLA violation rate stays ≤ 9% and, separately,
≤ 1% (bracket by doubling/halving, then bisection in log space), and reports token throughput there, the ratio
to ``container`` and the share of ``pooled-bound``'s gain that ``slice`` captures. Every policy runs on the same
workload, cluster and seed. Fidelity levels are a table (``FIDELITIES``); this module provides ``sim``, other
levels register a runner the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from shared.argtypes import nonneg_int, positive_float, positive_int
from shared.config import ConfigError, load_cluster
from shared.policies import CONTAINERS

BOUNDS = {"9": 0.09, "1": 0.01}

# fidelity -> "module:function"; the function runs one point: (args, policy, scale) -> result dict with at least
# tokens_per_s and violation_rate. Other fidelity levels add their entry here.
FIDELITIES: dict[str, str] = {"sim": "bench.bench_compare:run_sim_point",
                              "emulated": "bench.compare_mesh:run_emulated_point",
                              "real": "bench.compare_mesh:run_real_point"}
SERIAL_FIDELITIES = {"emulated", "real"}  # one mesh at a time on this machine; the policies' points alternate


class _Children:
    """The subprocesses of the running comparison's points. On an interrupt (Ctrl-C, SIGTERM, a CI timeout) they
    are terminated and no new point starts, so the comparison stops within seconds instead of carrying every
    policy's search to its end on the pool's threads first."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def run(self, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
        with self._lock:
            if self.stopping.is_set():
                raise RuntimeError("comparison interrupted")
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
            self._live.add(p)
        try:
            out, err = p.communicate()
        finally:
            with self._lock:
                self._live.discard(p)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def stop(self) -> None:
        with self._lock:
            self.stopping.set()
            live = list(self._live)
        for p in live:
            p.terminate()


CHILDREN = _Children()


class _Turns:
    """Round-robin turns for the policies' searches of a serial fidelity: one point at a time, policy after
    policy (container, slice, container, slice, ...), so a drift of the machine's speed over the run reaches every
    policy alike instead of whichever searched during it. A policy whose search has ended leaves the rotation."""

    def __init__(self, policies: list[str]) -> None:
        self.order = list(policies)
        self.turn = 0
        self.cond = threading.Condition()

    def run(self, policy: str, fn: Callable[[], Any]) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.order[self.turn % len(self.order)] == policy)
        try:
            return fn()
        finally:
            with self.cond:
                self.turn = (self.order.index(policy) + 1) % len(self.order)
                self.cond.notify_all()

    def leave(self, policy: str) -> None:
        with self.cond:
            i = self.order.index(policy)
            current = self.order[self.turn % len(self.order)]
            self.order.remove(policy)
            if self.order:
                self.turn = self.order.index(current) if current != policy else i % len(self.order)
            self.cond.notify_all()


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--policies", default="container,container-realloc,muxserve,token-pool,slice,pooled-bound")
    p.add_argument("--fidelity", default="sim", help=f"one of: {', '.join(FIDELITIES)}")
    p.add_argument("--seed", type=nonneg_int, default=None, help="workload/simulator seed (default: the file's)")
    p.add_argument("--duration-s", type=positive_float, default=None, help="replay only the first D seconds")
    p.add_argument("--start-scale", type=positive_float, default=4.0)
    p.add_argument("--tolerance", type=positive_float, default=0.04, help="stop when hi/lo < 1 + tolerance")
    p.add_argument("--max-scale", type=positive_float, default=256.0)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="policies searched in parallel (>1: each point in its own process)")
    p.add_argument("--containers", choices=CONTAINERS, default=None,
                   help="sim: sized from offered work (default) or the tenants file's home devices; the meshes "
                        "always run the home devices")
    p.add_argument("--confirm", type=int, default=None,
                   help="passes a reported point needs (replays until then; default 2 for --fidelity real, else 1)")
    p.add_argument("--json", dest="json_out", default=None)


def run_sim_point(args: argparse.Namespace, policy: str, scale: float) -> dict[str, Any]:
    """One simulator run: in this process with ``--jobs 1``, else in a subprocess (JSON out) so that several
    points use several cores."""
    keep = ("tokens_per_s", "violation_rate", "events", "wall_s", "leases")
    if args.jobs <= 1:
        from services.cli.simulate import load_workload_file, simulate
        w = load_workload_file(args.workload, scale, args.seed, args.duration_s)
        r = simulate(_cluster(args.cluster), w, policy, seed=args.seed, containers=containers_of(args))
        return {k: r[k] for k in keep if k in r} | {"device_utilization_mean": r["total"]["device_utilization_mean"]}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "services.cli.main", "simulate", "--cluster", args.cluster, "--workload",
               args.workload, "--policy", policy, "--rate-scale", repr(scale), "--json", str(out), "--progress", "off",
               "--containers", containers_of(args)]
        if args.seed is not None:
            cmd += ["--seed", str(args.seed)]
        if args.duration_s is not None:
            cmd += ["--duration-s", repr(args.duration_s)]
        p = CHILDREN.run(cmd, Path(__file__).resolve().parents[1])
        if p.returncode != 0:
            raise RuntimeError(f"simulate {policy} at scale {scale} failed: {p.stderr.strip()[-500:]}")
        r = json.loads(out.read_text())
    return {k: r[k] for k in keep if k in r} | {"device_utilization_mean": r["total"]["device_utilization_mean"]}


def containers_of(args: argparse.Namespace) -> str:
    """The containers a run uses: the mesh fidelities always run the tenants file's home devices."""
    c = getattr(args, "containers", None)
    return c or ("sized" if getattr(args, "fidelity", "sim") == "sim" else "homes")


_CLUSTERS: dict[str, Any] = {}


def _cluster(path: str):
    if path not in _CLUSTERS:
        _CLUSTERS[path] = load_cluster(path)
    return _CLUSTERS[path]


def _runner(fidelity: str) -> Callable[[argparse.Namespace, str, float], dict[str, Any]]:
    import importlib
    mod, fn = FIDELITIES[fidelity].split(":")
    return getattr(importlib.import_module(mod), fn)


class _Search:
    """Points of one policy, cached by scale, and the two bisections over them.

    With ``confirm`` > 1 a bound's answer is replayed until it has passed that many times: a point passes only if
    every replay does (its worst violation rate is kept) and its throughput is the replays' mean. A noisy mesh point
    that passed once by luck then fails, and the bisection goes on below it."""

    def __init__(self, policy: str, point: Callable[[float], dict[str, Any]], args: argparse.Namespace,
                 confirm: int = 1) -> None:
        self.policy, self.point, self.args = policy, point, args
        self.confirm = max(1, confirm)
        self.cache: dict[float, dict[str, Any]] = {}

    @staticmethod
    def _key(scale: float) -> float:
        return float(f"{scale:.6g}")

    def at(self, scale: float) -> dict[str, Any]:
        scale = self._key(scale)
        if scale not in self.cache:
            self.cache[scale] = dict(self.point(scale), replays=1)
        return self.cache[scale]

    def again(self, scale: float) -> dict[str, Any]:
        """Replay a cached point once more and merge (worst violation rate, mean throughput)."""
        scale = self._key(scale)
        old, r = self.cache[scale], self.point(scale)
        n = old["replays"]
        self.cache[scale] = dict(old, replays=n + 1,
                                 violation_rate=max(old["violation_rate"], r["violation_rate"]),
                                 tokens_per_s=(old["tokens_per_s"] * n + r["tokens_per_s"]) / (n + 1))
        return self.cache[scale]

    def max_scale(self, bound: float) -> tuple[float, dict[str, Any] | None]:
        while True:
            lo, r = self._bisect(bound)
            if r is None or r["replays"] >= self.confirm:
                return lo, r
            self.again(lo)  # passed fewer times than asked: replay it; a failure sends the bisection below it

    def _bisect(self, bound: float) -> tuple[float, dict[str, Any] | None]:
        a = self.args
        ok = sorted(s for s, r in self.cache.items() if r["violation_rate"] <= bound)
        bad = sorted(s for s, r in self.cache.items() if r["violation_rate"] > bound)
        lo = ok[-1] if ok else None
        hi = min((s for s in bad if lo is None or s > lo), default=None)
        s = a.start_scale if lo is None and hi is None else None
        while lo is None or hi is None:
            if s is None:
                s = hi / 2 if lo is None else lo * 2
            if s > a.max_scale or s < 1e-3:
                break
            r = self.at(s)
            if r["violation_rate"] <= bound:
                lo = s
            else:
                hi = s
            s = None
        if lo is None:
            return 0.0, None
        while hi is not None and hi / lo > 1 + a.tolerance:
            mid = math.sqrt(lo * hi)
            if self.at(mid)["violation_rate"] <= bound:
                lo = mid
            else:
                hi = mid
        return self._key(lo), self.at(lo)


def confirm_of(args: argparse.Namespace) -> int:
    """Passes a reported point needs: ``--confirm``, by default 2 on the real mesh (its single 60-s points move by
    ± 5-10 points of violations between replays) and 1 elsewhere (the simulator is deterministic)."""
    c = getattr(args, "confirm", None)
    return int(c) if c is not None else (2 if getattr(args, "fidelity", "sim") == "real" else 1)


def compare(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    point = _runner(args.fidelity)
    lock = threading.Lock()
    log: list[dict[str, Any]] = []

    serial = args.fidelity in SERIAL_FIDELITIES
    turns = _Turns(policies) if serial else None

    def search(policy: str) -> tuple[str, dict[str, Any]]:
        try:
            return policy, one_search(policy)
        finally:
            if turns is not None:
                turns.leave(policy)

    def one_search(policy: str) -> dict[str, Any]:
        def at(scale: float) -> dict[str, Any]:
            if CHILDREN.stopping.is_set():
                raise RuntimeError("comparison interrupted")
            r = turns.run(policy, lambda: point(args, policy, scale)) if turns else point(args, policy, scale)
            with lock:
                log.append({"policy": policy, "scale": scale, **{k: r[k] for k in ("tokens_per_s", "violation_rate",
                                                                                     "wall_s", "cpu_s") if k in r}})
                print(f"  {policy:18s} scale {scale:8.3f}: violations {r['violation_rate'] * 100:6.2f}%  "
                      f"{r['tokens_per_s']:10.1f} tok/s", file=sys.stderr, flush=True)
            return r
        s = _Search(policy, at, args, confirm_of(args))
        out: dict[str, Any] = {}
        for key, bound in BOUNDS.items():
            scale, r = s.max_scale(bound)
            out[f"max_scale_{key}"] = scale
            out[f"tokens_per_s_{key}"] = r["tokens_per_s"] if r else 0.0
            if key == "9":
                out["violation_rate"] = r["violation_rate"] if r else None
                out["leases"] = r.get("leases") if r else None
        return out

    t0 = time.perf_counter()
    jobs = len(policies) if serial else max(1, args.jobs)  # serial: one thread per search, turns keep one point
    CHILDREN.stopping.clear()
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        try:
            results = dict(ex.map(search, policies))
        except BaseException:  # an interrupt or a failed point: stop the other searches' points too
            CHILDREN.stop()
            raise
    res: dict[str, Any] = {"policies": {p: results[p] for p in policies}, "fidelity": args.fidelity,
                           "workload": args.workload, "cluster": args.cluster, "seed": args.seed,
                           "duration_s": args.duration_s, "containers": containers_of(args),
                           "confirm": confirm_of(args),
                           "wall_s": time.perf_counter() - t0}
    res["ratio_to_container"] = ratios(res["policies"])
    res["pooled_gain_captured"] = captured(res["policies"])
    res["runs"] = sorted(log, key=lambda x: (x["policy"], x["scale"]))
    return res


def ratios(pol: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """tokens/s of each policy over container's, at each bound."""
    if "container" not in pol:
        return {}
    out = {}
    for name, r in pol.items():
        out[name] = {}
        for key in BOUNDS:
            base = pol["container"][f"tokens_per_s_{key}"]
            out[name][key] = r[f"tokens_per_s_{key}"] / base if base else None
    return out


def captured(pol: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """(policy − container) / (pooled-bound − container) per policy, at each bound."""
    if "container" not in pol or "pooled-bound" not in pol:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for name, r in pol.items():
        if name in ("container", "pooled-bound"):
            continue
        out[name] = {}
        for key in BOUNDS:
            c, p = pol["container"][f"tokens_per_s_{key}"], pol["pooled-bound"][f"tokens_per_s_{key}"]
            out[name][key] = (r[f"tokens_per_s_{key}"] - c) / (p - c) if p - c > 0 else None
    return out


def run(args: argparse.Namespace) -> int:
    from shared.policies import POLICIES
    if args.fidelity not in FIDELITIES:
        print(f"slicesched bench compare: unknown fidelity {args.fidelity!r}; valid: {', '.join(FIDELITIES)}",
              file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"slicesched bench compare: unknown policy {', '.join(bad) or '(none)'}; valid: "
              f"{', '.join(POLICIES.names())}", file=sys.stderr)
        return 2
    if args.confirm is not None and args.confirm < 1:
        print(f"slicesched bench compare: --confirm must be at least 1 (got {args.confirm})", file=sys.stderr)
        return 2
    if args.fidelity != "sim" and getattr(args, "containers", None) == "sized":
        print(f"slicesched bench compare: --containers sized is for --fidelity sim; the {args.fidelity} mesh runs "
              "the tenants file's home devices", file=sys.stderr)
        return 2
    load_cluster(args.cluster)
    if not Path(args.workload).is_file():
        raise ConfigError(args.workload, "(file)", "workload file not found")
    res = compare(args, policies)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1))
    rat = res["ratio_to_container"]
    print(f"{'policy':18s} {'scale@9%':>9s} {'tok/s@9%':>10s} {'x cont.':>8s} {'scale@1%':>9s} {'tok/s@1%':>10s}")
    for name, r in res["policies"].items():
        x = rat.get(name, {}).get("9")
        print(f"{name:18s} {r['max_scale_9']:9.3f} {r['tokens_per_s_9']:10.1f} "
              f"{(f'{x:.2f}' if x else '-'):>8s} {r['max_scale_1']:9.3f} {r['tokens_per_s_1']:10.1f}")
    if res["pooled_gain_captured"]:
        print("share of pooled-bound's gain captured (9%):",
              {k: (round(v['9'], 3) if v['9'] is not None else None) for k, v in res["pooled_gain_captured"].items()})
    return 0
