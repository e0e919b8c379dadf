"""Mesh fidelities of ``slicesched bench compare``: one point = start the real mesh (every service, a private
Redis, the gateway) with one policy, replay the workload over HTTP at a rate scale with the load generator, stop.

* ``emulated``: the cluster's devices must be ``backend: emulated`` (time from the device profile, memory
  accounted, placeholder tokens) — results are labelled emulated.
* ``real``: ``cpu``/``cuda`` devices computing for real.

Points run one at a time (one mesh on the machine), the policies taking turns point by point (container, slice,
container, ...; ``bench_compare._Turns``) so that a drift of the machine's speed during the run reaches every
policy alike; ``--jobs`` is ignored for these fidelities.
"""
from __future__ import annotations

from services.launcher import MEASURE_ENV

import argparse
import json
import re
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis as syncredis
import yaml

from shared.config import ConfigError, load_cluster


def _tenants_file(workload: str) -> str:
    data = yaml.safe_load(Path(workload).read_text()) or {}
    t = data.get("tenants")
    if not isinstance(t, str):
        raise ConfigError(workload, "tenants", "mesh fidelities need the workload to name a tenants file")
    return str((Path(workload).parent / t).resolve())


def steering_env(args: argparse.Namespace, policy: str) -> tuple[str, dict[str, str]]:
    """(the registered policy, the scheduler's SLICESCHED_SIM_STEERING for this point): from a
    ``<policy>/steering-on|off`` name of ``--sim-steering both``, else from ``--sim-steering on|off`` (nothing:
    the environment's)."""
    name, _, variant = policy.partition("/")
    mode = {"steering-on": "on", "steering-off": "off"}.get(variant) or getattr(args, "sim_steering", None)
    return name, ({"SLICESCHED_SIM_STEERING": "1" if mode == "on" else "0"} if mode in ("on", "off") else {})


def point_env(args: argparse.Namespace, policy: str) -> tuple[str, dict[str, str]]:
    """(the registered policy, the environment its mesh point adds): the scheduler's steering
    (:func:`steering_env`), its policy parameters (``--lane-handback``: SLICESCHED_POLICY_PARAMS) and, with
    ``--deadline-chunks``, the workers' prefill order (SLICESCHED_DEADLINE_CHUNKS 1 for the policies named, 0 for
    the others; without the option the environment's), with ``--step-cap`` the workers' step cap
    (SLICESCHED_STEP_CAP_S, 0 for the policies not named)."""
    from bench.bench_compare import cap_for, chunks_for, handback_params
    params = handback_params(args, policy)
    chunks = chunks_for(args, policy)
    name, env = steering_env(args, policy)
    if params:
        env = env | {"SLICESCHED_POLICY_PARAMS": json.dumps(params)}
    if getattr(args, "deadline_chunks", None):
        env = env | {"SLICESCHED_DEADLINE_CHUNKS": "1" if chunks else "0"}
    if getattr(args, "step_cap", None):
        env = env | {"SLICESCHED_STEP_CAP_S": repr(cap_for(args, policy))}
    return name, env


def _scheduler_metrics(redis_url: str, prefix: str) -> tuple[dict[str, float], dict[str, float]]:
    """(lease counters, steering gauges) scraped from the scheduler's /metrics (found through its health key)."""
    r = syncredis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        port = r.hget(f"{prefix}health:scheduler:scheduler-0", "port")
        # lane hand-offs the workers made (as the simulator's leases.handed_back)
        handed = sum(int(r.hget(k, "handoffs_sent") or 0) for k in r.scan_iter(f"{prefix}health:worker:*"))
    finally:
        r.close()
    if not port:
        return {}, {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{int(port)}/metrics", timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return {}, {}
    out = {}
    for m in re.finditer(r'^slicesched_leases_total\{event="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    if handed:
        out["handed_back"] = float(handed)
    steer = {m.group(1): float(m.group(2)) for m in re.finditer(  # (age: NaN, left out, when none was seen)
        r'^slicesched_scheduler_sim_steering_(version|factors|age_seconds) ([0-9.e+-]+)$', text, re.M)}
    return out, steer


def tenants_with_homes(tenants_file: str, homes: dict[str, list[str]] | None, out_dir: Path) -> str:
    """The tenants file the mesh starts with: ``tenants_file`` itself, or a copy whose tenants' ``home_devices``
    are ``homes`` (the planned partition) in ``out_dir``."""
    if not homes:
        return tenants_file
    data = yaml.safe_load(Path(tenants_file).read_text())
    for t in data["tenants"]:
        t["home_devices"] = list(homes[t["name"]])
        for key in ("checkpoint",):  # relative paths stay valid from the copy's folder
            m = t.get("model")
            if isinstance(m, dict) and isinstance(m.get(key), str) and not Path(m[key]).is_absolute():
                m[key] = str((Path(tenants_file).parent / m[key]).resolve())
    out = out_dir / "tenants.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(out)


def _point(args: argparse.Namespace, policy: str, scale: float, fidelity: str) -> dict[str, Any]:
    from loadgen.runner import run_replay
    from services.launcher import Launcher

    cluster = load_cluster(args.cluster)
    want = {"emulated"} if fidelity == "emulated" else {"cpu", "cuda"}
    bad = [d.id for d in cluster.devices if d.backend not in want]
    if bad:
        raise ConfigError(cluster.source, "devices", f"fidelity {fidelity!r} needs {'/'.join(sorted(want))} devices; "
                                                      f"{', '.join(bad)} are not")
    policy, steer_env = point_env(args, policy)
    if policy == "pooled-bound":
        raise ConfigError("--policies", "pooled-bound", "simulation-only bound: not run on a mesh")
    with tempfile.TemporaryDirectory(prefix=f"slicesched-{fidelity}-") as tmp:
        tenants = tenants_with_homes(_tenants_file(args.workload), getattr(args, "homes", None), Path(tmp))
        launcher = Launcher(cluster, cluster_file=str(Path(args.cluster).resolve()), tenants_file=tenants,
                            data_dir=Path(tmp), gateway_port=0, policy=policy, prefix="bench:",
                            extra_env=MEASURE_ENV | steer_env)
        hook = getattr(args, "mesh_hook", None)  # bench results: reads the run's streams for a busy-time timeline
        t0 = time.perf_counter()
        launcher.start()
        try:
            if hook is not None:
                hook.started(launcher, policy, scale)
            cpu0 = launcher.cpu_seconds(client=True)
            summary = run_replay(args.workload, launcher.gateway_url, str(Path(tmp) / "replay"), tenants_file=tenants,
                                 rate_scale=scale, duration_s=args.duration_s, progress=False,
                                 timeout_s=getattr(args, "request_timeout_s", 120.0))
            cpu = {k: round(v - cpu0[k], 3) for k, v in launcher.cpu_seconds(client=True).items()
                   if k in cpu0}
            leases, steering = _scheduler_metrics(launcher.redis_url, "bench:")
            if hook is not None:
                hook.finished(launcher, policy, scale, summary)
        finally:
            launcher.stop(drain_s=10)
    from bench.bench_compare import point_summary
    return point_summary({"tokens_per_s": summary["tokens_per_s"], "violation_rate": summary["violation_rate"],
                          "wall_s": time.perf_counter() - t0, "leases": leases, "cpu_s": cpu,
                          "steering": dict(steering, setting=steer_env.get("SLICESCHED_SIM_STEERING", "env")),
                          "tenants": summary.get("tenants") or {}}) | {
        "fidelity": fidelity, "requests": summary.get("total", {}).get("requests")}


def run_emulated_point(args: argparse.Namespace, policy: str, scale: float, seed: int | None = None,
                       stop_above: float | None = None) -> dict[str, Any]:
    """One emulated-mesh point (the workload file's seed; a mesh point always runs to its end)."""
    return _point(args, policy, scale, "emulated")


def run_real_point(args: argparse.Namespace, policy: str, scale: float, seed: int | None = None,
                   stop_above: float | None = None) -> dict[str, Any]:
    """One real-mesh point (the workload file's seed; a mesh point always runs to its end)."""
    return _point(args, policy, scale, "real")
