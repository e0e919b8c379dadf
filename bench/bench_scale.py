"""``slicesched bench scale``: the control plane at scale — decision latency, what-if latency and simulator speed
over a grid of cluster sizes × tenant counts, with a plot of how they grow.

For every point (``devices`` × ``tenants``, tenants ≤ devices) it writes the configs of
:mod:`bench.scale_configs` (modelled H100s, tenants shaped as the 16-tenant mix, the Azure mix scaled to the
cluster) and runs, each as its own ``slicesched`` process so that every figure is reproducible by that command
alone:

* ``slicesched bench decisions`` (the live scheduler's snapshot + ``slice`` decision + GMG commit, real Redis);
* ``slicesched bench whatif`` (the what-if RPC through the simulator service, real Redis);
* ``slicesched bench simspeed`` (``slice`` replaying the scaled Azure mix, containers sized by offered work).

The commands, their JSON, the machine, the date and the load average before and after each go into ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.argtypes import positive_float, positive_int
from shared.config import ConfigError

PARTS = ("decisions", "whatif", "simulate")


def _int_list(v: str) -> list[int]:
    try:
        out = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {v!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {v!r}")
    return out


def _parts(v: str) -> list[str]:
    out = [x.strip() for x in v.split(",") if x.strip()]
    bad = [x for x in out if x not in PARTS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {v!r}")
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=_int_list, default=[32, 256, 1024], help="cluster sizes (comma-separated)")
    p.add_argument("--tenants", type=_int_list, default=[16, 64, 256], help="tenant counts (comma-separated)")
    p.add_argument("--parts", type=_parts, default=list(PARTS), help=f"which to run: {','.join(PARTS)}")
    p.add_argument("--decisions", type=positive_int, default=300)
    p.add_argument("--queries", type=positive_int, default=500, help="what-if queries per point")
    p.add_argument("--sim-duration-s", type=positive_float, default=3600.0, help="simulated seconds per point")
    p.add_argument("--sim-policy", default="slice")
    p.add_argument("--rate-scale", type=positive_float, default=1.0,
                   help="load per device relative to the 32-device Azure mix (the workload's scale is this x D/32)")
    p.add_argument("--containers", default="sized", help="the simulation's static partition (homes|sized|FILE)")
    p.add_argument("--configs-dir", default=None, help="keep the generated configs here (default: a temp dir)")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--plot", default=None, help="write the growth curves here (PNG)")
    p.add_argument("--from-json", default=None, help="only plot an earlier run's JSON (no measurements)")


def _run(cmd: list[str], json_path: Path, env: dict[str, str]) -> dict:
    """Run one ``slicesched`` command; its JSON plus the command line, wall seconds and load average."""
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", *cmd], env=env, capture_output=True,
                          text=True)
    wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    if proc.returncode != 0 or not json_path.is_file():
        raise RuntimeError(f"`slicesched {' '.join(cmd)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return {"command": "slicesched " + " ".join(cmd), "result": json.loads(json_path.read_text()),
            "process_wall_s": wall, "loadavg_1m": {"start": load0, "end": load1}}


def measure(args: argparse.Namespace, root: Path) -> dict:
    from bench.scale_configs import REFERENCE_DEVICES, write_scale_configs
    env = dict(os.environ)
    env.setdefault("SLICESCHED_TRACES", str(Path(__file__).resolve().parent.parent.parent / "shared" / "traces"))
    points = []
    for n_dev in args.devices:
        for n_ten in args.tenants:
            if n_ten > n_dev:
                continue
            cfg = write_scale_configs(root / f"{n_dev}x{n_ten}", n_dev, n_ten, rate_scale=args.rate_scale)
            out = cfg.cluster.parent
            point: dict = {"devices": n_dev, "tenants": n_ten, "configs": str(out)}
            print(f"scale: {n_dev} devices x {n_ten} tenants ...", flush=True)
            if "decisions" in args.parts:
                point["decisions"] = _run(["bench", "decisions", "--cluster", str(cfg.cluster), "--tenants-file",
                                           str(cfg.tenants), "--devices", str(n_dev), "--tenants", str(n_ten),
                                           "--decisions", str(args.decisions), "--json", str(out / "decisions.json")],
                                          out / "decisions.json", env)
            if "whatif" in args.parts:
                point["whatif"] = _run(["bench", "whatif", "--cluster", str(cfg.cluster), "--tenants",
                                        str(cfg.tenants), "--queries", str(args.queries), "--json",
                                        str(out / "whatif.json")], out / "whatif.json", env)
            if "simulate" in args.parts:
                scale = args.rate_scale * n_dev / REFERENCE_DEVICES
                point["simulate"] = _run(["bench", "simspeed", "--cluster", str(cfg.cluster), "--workload",
                                          str(cfg.workload), "--policy", args.sim_policy, "--containers",
                                          args.containers, "--rate-scale", f"{scale:g}", "--duration-s",
                                          f"{args.sim_duration_s:g}", "--json", str(out / "simulate.json")],
                                         out / "simulate.json", env)
            points.append(point)
            print(json.dumps(summary_row(point)), flush=True)
    return {"points": points, "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.node()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rate_scale_per_32": args.rate_scale,
            "sim_duration_s": args.sim_duration_s, "sim_policy": args.sim_policy, "containers": args.containers}


def summary_row(p: dict) -> dict:
    """The headline numbers of one point."""
    row: dict = {"devices": p["devices"], "tenants": p["tenants"]}
    if "decisions" in p:
        r = p["decisions"]["result"]
        row.update(decision_p50_ms=r["p50_ms"], decision_p99_ms=r["p99_ms"], committed=r["committed"],
                   committed_p99_ms=r["committed_p99_ms"],
                   snapshot_p99_ms=r["committed_phases_p99_ms"]["snapshot"],
                   decide_p99_ms=r["committed_phases_p99_ms"]["decide"], admission_p99_ms=r["admission_p99_ms"])
    if "whatif" in p:
        r = p["whatif"]["result"]
        row.update(whatif_rpc_p99_ms=r["rpc_ms"]["p99"], whatif_compute_p99_ms=r["compute_ms"]["p99"])
    if "simulate" in p:
        r = p["simulate"]["result"]
        row.update(sim_requests=r["requests"], sim_wall_s=r["wall_s"], sim_cpu_s=r["cpu_s"],
                   sim_build_s=r["workload_build_s"], sim_load=r["loadavg_1m"]["end"])
    return row


def plot(result: dict, path: str | Path) -> Path:
    """Decision p99, what-if p99 and simulator seconds against devices, one line per tenant count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [summary_row(p) for p in result["points"]]
    tenants = sorted({r["tenants"] for r in rows})
    panels = [("committed_p99_ms", "decision p99 (ms), decisions that commit"),
              ("whatif_rpc_p99_ms", "what-if RPC p99 (ms)"),
              ("sim_wall_s", f"{result['sim_duration_s'] / 3600:.3g} h simulated: wall s")]
    targets = {"committed_p99_ms": 10.0, "sim_wall_s": 600.0 if result["sim_duration_s"] >= 3600 else None}
    panels = [pn for pn in panels if any(pn[0] in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for t in tenants:
            pts = sorted((r["devices"], r[key]) for r in rows if r["tenants"] == t and key in r
                         and r[key] == r[key])  # NaN: no decision committed at that point
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{t} tenants")
        if targets.get(key):
            ax.axhline(targets[key], ls="--", color="grey", lw=0.8, label="target")
        ax.set_xscale("log", base=2)
        xs = sorted({r["devices"] for r in rows})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"control plane at scale ({result['date']}, {result['machine'].split(',')[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        if not Path(args.from_json).is_file():
            raise ConfigError(args.from_json, "(file)", "file not found")
        result = json.loads(Path(args.from_json).read_text())
    else:
        if args.configs_dir:
            result = measure(args, Path(args.configs_dir))
        else:
            with tempfile.TemporaryDirectory(prefix="slicesched-scale-") as tmp:
                result = measure(args, Path(tmp))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    for p in result["points"]:
        print(json.dumps(summary_row(p)))
    if args.plot:
        print(f"plot: {plot(result, args.plot)}")
    return 0
