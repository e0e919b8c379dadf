"""``slicesched simulate``: replay a workload file on a modelled cluster with one policy (offline simulator)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from loadgen.mix import SCALE_MODES
from shared.argtypes import fraction, nonneg_float, nonneg_int
from shared.config import ClusterConfig, ConfigError, load_cluster
from shared.registry import UnknownNameError
from shared.workload import Workload

PROGRESS_MIN_REQUESTS = 20000


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster.yaml of the modelled cluster")
    p.add_argument("--workload", required=True, help="workload file (docs/loadgen.md)")
    p.add_argument("--policy", required=True, help="policy name (see docs/policies.md)")
    p.add_argument("--rate-scale", type=float, default=None, help="multiply arrival rates (default: the file's)")
    p.add_argument("--seed", type=nonneg_int, default=None, help="override the workload's seed (arrivals and simulator)")
    p.add_argument("--scale-mode", choices=SCALE_MODES, default=None,
                   help="how --rate-scale adds load: superpose (independent copies: more users; the file's default) "
                        "or compress (the trace compressed in time: sharper bursts, a stress variant)")
    p.add_argument("--duration-s", type=float, default=None, help="replay only the first D seconds")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="policy parameter (repeat); overrides the cluster file's policies.<name> key by key")
    p.add_argument("--containers", default="homes", metavar="homes|sized|FILE",
                   help="the static partition every policy starts from: homes (the tenants file's home devices, "
                        "default), sized (by average offered work, container-avgwork's sizing) or a containers file "
                        "(tenant -> devices or count, as `slicesched plan containers` writes)")
    p.add_argument("--step-by-step", action="store_true", help="no closed-form decode runs (slower; for checks)")
    p.add_argument("--deadline-chunks", action="store_true",
                   help="engines admit and chunk prompts by first-token deadline and cut a step short of a chunk "
                        "that would make a prompt it completes late (the workers' SLICESCHED_DEADLINE_CHUNKS; off by "
                        "default)")
    p.add_argument("--step-cap-s", type=nonneg_float, default=0.0, metavar="S",
                   help="while sequences decode, an engine's step takes prefill tokens only while its predicted time "
                        "stays within S seconds (TPOT-bounded chunked prefill; the workers' SLICESCHED_STEP_CAP_S; "
                        "0, the default: no cap)")
    p.add_argument("--stop-above", type=fraction, default=None,
                   help="stop as soon as the run is known to violate more than this fraction (in aggregate or for a "
                        "tenant with >= 100 requests); its figures then cover the requests arrived so far")
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
                       duration_s: float | None = None, scale_mode: str | None = None) -> Workload:
    """Build a workload from its file (loadgen), optionally with another seed and scale mode, cut to
    ``duration_s``."""
    if not Path(path).is_file():
        raise ConfigError(path, "(file)", "workload file not found")
    from loadgen.workload import read_workload_spec, workload_from_spec
    spec = read_workload_spec(path)
    if seed is not None:
        spec = dataclasses.replace(spec, seed=seed)
    if scale_mode is not None:
        spec = dataclasses.replace(spec, scale_mode=scale_mode)
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


CONTAINER_MODES = ("homes", "sized")


def homes_for(containers: str | Mapping[str, Any] | None, cluster: ClusterConfig,
              w: Workload) -> dict[str, tuple[str, ...]] | None:
    """The containers a run uses: None for the tenants file's home devices (``homes``), average-work sizing
    (``sized``), a mapping tenant -> device ids as given, or else a containers file's path."""
    from shared.containers import parse_containers, read_containers
    from shared.policies.sizing import avgwork_homes
    if containers is None or containers == "homes":
        return None
    if containers == "sized":
        return {t: tuple(ds) for t, ds in avgwork_homes(cluster, w).items()}
    if isinstance(containers, Mapping):
        return parse_containers(containers, "--containers", cluster, w.tenants)
    return read_containers(containers, cluster, w.tenants)


def with_containers(w: Workload, homes: Mapping[str, Any] | None) -> Workload:
    """``w`` with its tenants' home devices replaced by ``homes`` (unchanged for None)."""
    from shared.containers import with_homes
    return w if homes is None else dataclasses.replace(w, tenants=with_homes(w.tenants, homes))


def simulate(cluster: ClusterConfig, w: Workload, policy_name: str, params: dict[str, Any] | None = None,
             seed: int | None = None, step_by_step: bool = False, progress: Any = None,
             containers: str | Mapping[str, Any] | None = "homes", stop_above: float | None = None,
             anatomy_bin_s: float | None = None, deadline_chunks: bool = False,
             step_cap_s: float = 0.0) -> dict[str, Any]:
    """Run one simulation; returns the result dict with ``wall_s`` added. The policy gets the cluster file's
    ``policies.<name>`` overridden by ``params``, as the live scheduler does (:func:`policy_params`), and starts
    from the containers ``containers`` names (:func:`homes_for`). With ``anatomy_bin_s`` the result also holds
    ``anatomy`` (:func:`shared.sim.anatomy.anatomy`: violations by cause, idle capacity during TTFT waits)."""
    from shared.policies import POLICIES, make_policy, policy_params
    from shared.sim import SimConfig, Simulator
    w = with_containers(w, homes_for(containers, cluster, w))
    if getattr(POLICIES.get(policy_name), "analytic", False):
        return ceiling_result(cluster, w, policy_name)
    policy = make_policy(policy_name, policy_params(policy_name, cluster.policy_params.get(policy_name), params))
    cfg = SimConfig(closed_form=not step_by_step, deadline_chunks=deadline_chunks, step_cap_s=step_cap_s)
    rng = random.Random(w.seed if seed is None else seed)
    t0 = time.perf_counter()
    sim = Simulator(cluster, w.tenants, policy, cfg, rng)
    if stop_above is not None:
        from shared.sim.metrics import MIN_TENANT_REQUESTS
        sim.stop_above(w, stop_above, MIN_TENANT_REQUESTS)
    if anatomy_bin_s is not None:
        sim.record_busy(anatomy_bin_s)
    result = sim.run(w, progress=progress)
    out = result.to_dict()
    if anatomy_bin_s is not None:
        from shared.sim.anatomy import anatomy
        out["anatomy"] = anatomy(sim, w, anatomy_bin_s)
    out["homes"] = {t.name: list(t.home_devices) for t in w.tenants.tenants}
    out["deadline_chunks"] = deadline_chunks
    out["step_cap_s"] = step_cap_s
    out["wall_s"] = time.perf_counter() - t0
    out["events_per_s"] = out["events"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
    return out


def ceiling_result(cluster: ClusterConfig, w: Workload, name: str) -> dict[str, Any]:
    """``pooled-bound``: the analytic ceiling at this workload's scale (:mod:`shared.sim.ceiling`), in the shape of a
    simulator result (no tenants: the bound is an aggregate)."""
    from shared.sim.ceiling import ceiling_point
    t0 = time.perf_counter()
    r = ceiling_point(cluster, w)
    n = r["requests"]
    total = {"requests": n, "violations": r["violations_lower_bound"], "violation_rate": r["violation_rate"],
             "ttft_ms": {"p99": None}, "tpot_ms": {"p99": None}, "device_utilization_mean": r["utilisation_lower_bound"],
             "worst_tenant": None, "worst_tenant_violation_rate": 0.0}
    return {**r, "policy": {"name": name, "params": {}}, "workload": w.name, "seed": w.seed, "rate_scale": w.rate_scale,
            "events": 0, "total": total, "tenants": {}, "wall_s": time.perf_counter() - t0, "events_per_s": 0.0,
            "homes": {t.name: list(t.home_devices) for t in w.tenants.tenants}}


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
    w = load_workload_file(args.workload, args.rate_scale, args.seed, args.duration_s, args.scale_mode)
    check_tenants_fit(cluster, w)
    show = args.progress == "on" or (args.progress == "auto" and len(w.requests) >= PROGRESS_MIN_REQUESTS)
    bar, update = _bar(show)
    try:
        out = simulate(cluster, w, args.policy, params, args.seed, args.step_by_step, update, args.containers,
                       args.stop_above, deadline_chunks=args.deadline_chunks, step_cap_s=args.step_cap_s)
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
    if out.get("fidelity") == "analytic bound":
        print(f"{args.policy}: at most {out['tokens_per_s']:.1f} tokens/s (every offered token), violations at least "
              f"{out['violation_rate'] * 100:.2f}% ({out['violations_lower_bound']} of {out['requests']}); "
              f"device time at least {out['utilisation_lower_bound'] * 100:.1f}% of the cluster (analytic bound)")
        return 0
    print(f"{args.policy}: {out['tokens_per_s']:.1f} tokens/s, violations {out['violation_rate'] * 100:.2f}%, "
          f"TTFT p99 {t['ttft_ms']['p99'] or 0:.1f} ms, TPOT p99 {t['tpot_ms']['p99'] or 0:.2f} ms, "
          f"{out['events']} events in {out['wall_s']:.2f} s (simulated)")
    return 0
