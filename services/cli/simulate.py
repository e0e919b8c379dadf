"""``slicesched simulate``: replay a workload file on a modelled cluster with one policy (offline simulator)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from shared.argtypes import nonneg_int
from shared.config import ClusterConfig, ConfigError, load_cluster
from shared.policies import CONTAINERS
from shared.registry import UnknownNameError
from shared.workload import Workload

PROGRESS_MIN_REQUESTS = 20000


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster.yaml of the modelled cluster")
    p.add_argument("--workload", required=True, help="workload file (docs/loadgen.md)")
    p.add_argument("--policy", required=True, help="policy name (see docs/policies.md)")
    p.add_argument("--rate-scale", type=float, default=None, help="multiply arrival rates (default: the file's)")
    p.add_argument("--seed", type=nonneg_int, default=None, help="override the workload's seed (arrivals and simulator)")
    p.add_argument("--duration-s", type=float, default=None, help="replay only the first D seconds")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="policy parameter (repeat); overrides the cluster file's policies.<name> key by key")
    p.add_argument("--containers", choices=CONTAINERS, default="sized",
                   help="sized: containers sized from each tenant's offered work (default); homes: the tenants "
                        "file's home devices, as the live mesh runs them")
    p.add_argument("--step-by-step", action="store_true", help="no closed-form decode runs (slower; for checks)")
    p.add_argument("--json", dest="json_out", default=None, help="write the metrics here")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="progress bar on stderr")


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict with numbers/bools converted."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("--param", item, "expected KEY=VALUE")
        k, v = item.split("=", 1)
        low = v.lower()
        if low in ("true", "false"):
            out[k] = low == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def load_workload_file(path: str, rate_scale: float | None, seed: int | None = None,
                       duration_s: float | None = None) -> Workload:
    """Build a workload from its file (loadgen), optionally with another seed and cut to ``duration_s``."""
    if not Path(path).is_file():
        raise ConfigError(path, "(file)", "workload file not found")
    from loadgen.workload import read_workload_spec, workload_from_spec
    spec = read_workload_spec(path)
    if seed is not None:
        spec = dataclasses.replace(spec, seed=seed)
    w = workload_from_spec(spec, rate_scale)
    if not w.requests:
        raise ConfigError(path, "traces", "the workload has no requests")
    if duration_s is not None:
        if duration_s <= 0:
            raise ConfigError("--duration-s", "value", "must be positive")
        w = dataclasses.replace(w, requests=tuple(r for r in w.requests if r.arrival_s < duration_s),
                                duration_s=min(w.duration_s or duration_s, duration_s))
    return w


def check_tenants_fit(cluster: ClusterConfig, w: Workload) -> None:
    """Every tenant's home devices must exist in the cluster we simulate."""
    ids = {d.id for d in cluster.devices}
    for i, t in enumerate(w.tenants.tenants):
        for h in t.home_devices:
            if h not in ids:
                raise ConfigError(w.tenants.source, f"tenants[{i}].home_devices",
                                  f"device {h!r} is not in {cluster.source}")


def simulate(cluster: ClusterConfig, w: Workload, policy_name: str, params: dict[str, Any] | None = None,
             seed: int | None = None, step_by_step: bool = False, progress: Any = None,
             containers: str = "sized") -> dict[str, Any]:
    """Run one simulation; returns the result dict with ``wall_s`` added. The policy gets the cluster file's
    ``policies.<name>`` overridden by ``params``, as the live scheduler does (:func:`policy_params`)."""
    from shared.policies import make_policy, policy_params
    from shared.sim import SimConfig, Simulator
    policy = make_policy(policy_name, policy_params(policy_name, cluster.policy_params.get(policy_name), params,
                                                    containers))
    cfg = SimConfig(closed_form=not step_by_step)
    rng = random.Random(w.seed if seed is None else seed)
    t0 = time.perf_counter()
    sim = Simulator(cluster, w.tenants, policy, cfg, rng)
    result = sim.run(w, progress=progress)
    out = result.to_dict()
    out["wall_s"] = time.perf_counter() - t0
    out["events_per_s"] = out["events"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
    return out


def _bar(enabled: bool):
    if not enabled:
        return None, None
    from tqdm import tqdm
    bar = tqdm(total=1000, file=sys.stderr, desc="simulate", unit="‰", leave=False)

    def update(frac: float) -> None:
        bar.update(int(frac * 1000) - bar.n)
    return bar, update


def run(args: argparse.Namespace) -> int:
    from shared.policies import make_policy
    from shared.policies.base import PolicyConfigError
    params = parse_params(args.param)
    try:
        make_policy(args.policy, params)
    except (UnknownNameError, PolicyConfigError) as e:
        print(f"slicesched simulate: {e}", file=sys.stderr)
        return 2
    cluster = load_cluster(args.cluster)
    w = load_workload_file(args.workload, args.rate_scale, args.seed, args.duration_s)
    check_tenants_fit(cluster, w)
    show = args.progress == "on" or (args.progress == "auto" and len(w.requests) >= PROGRESS_MIN_REQUESTS)
    bar, update = _bar(show)
    try:
        out = simulate(cluster, w, args.policy, params, args.seed, args.step_by_step, update, args.containers)
    except (UnknownNameError, PolicyConfigError) as e:
        print(f"slicesched simulate: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    out.update(cluster=args.cluster, workload_file=args.workload, containers=args.containers)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    t = out["total"]
    print(f"{args.policy}: {out['tokens_per_s']:.1f} tokens/s, violations {out['violation_rate'] * 100:.2f}%, "
          f"TTFT p99 {t['ttft_ms']['p99'] or 0:.1f} ms, TPOT p99 {t['tpot_ms']['p99'] or 0:.2f} ms, "
          f"{out['events']} events in {out['wall_s']:.2f} s (simulated)")
    return 0
