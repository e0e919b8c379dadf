"""``slicesched bench results``: regenerate every table and plot of docs/results.md and the README headline.

Three fidelities, each its own part (``--only``), each written to ``--out`` as raw JSON (``bench compare``'s result
plus a ``meta`` block: fidelity label, machine, date, exact command, wall time) and PNGs:

* ``sim``: ``bench compare --fidelity sim`` of all six policies on the Azure α ∈ {0.7, 1.3, 2.1} and ServeGen
  16-tenant workloads on 32 modelled H100s (``sim-<workload>.json/png``);
* ``emulated``: container vs slice on the emulated 8-device mesh (``emulated.json/png``), the simulator's
  prediction for the same workload and cluster (``emulated-prediction.json/png``), and a device busy-time
  timeline under slice (``emulated-timeline.json/png``);
* ``real``: container vs slice on the real 2-device CPU mesh (``real.json/png``, ``real-timeline.json/png``).

Each mesh search runs ``--emulated-runs`` / ``--real-runs`` times (default 3, ``--quick`` 1; the method reads the
median): the second and later runs go to ``<part>-run2.json``, ``<part>-run3.json``, … and a new first run removes
the files of an earlier invocation. The prediction is computed once (the simulator is deterministic).

Then docs/results.md and the README block between ``<!-- results:begin -->`` and ``<!-- results:end -->`` are
rendered from every JSON present in ``--out`` (so one part can be rerun alone). ``--quick`` runs a smoke version of
each part (short traces, coarse search).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.argtypes import name_list, name_seconds, positive_float, positive_int, seed_list
from shared.config import ConfigError, load_cluster

PARTS = ("sim", "emulated", "real")
SIM_WORKLOADS = ("configs/workloads/azure-16mix-a0.7.yaml", "configs/workloads/azure-16mix-a1.3.yaml",
                 "configs/workloads/azure-16mix-a2.1.yaml", "configs/workloads/servegen-16mix.yaml")
SIM_CLUSTER = "configs/cluster-h100x32.yaml"
SIM_POLICIES = "container,container-avgwork,container-realloc,muxserve,token-pool,slice,pooled,pooled-bound"
EMULATED = ("configs/workloads/emulated-6mix.yaml", "configs/cluster-emulated8.yaml")
REAL = ("configs/workloads/tiny-bursty.yaml", "configs/cluster-tiny.yaml")
MESH_POLICIES = ("container", "slice")
MESH_PARTS = ("emulated", "real")
PNG_MAX_BYTES = 150_000


@dataclass(frozen=True)
class Search:
    """How one part searches the max sustainable rate scale (see ``bench compare``)."""

    duration_s: float | None
    start_scale: float
    tolerance: float
    max_scale: float
    seeds: tuple[int, ...] | None = None  # reporting arrival seeds (None: the workload file's)
    tuning_seeds: tuple[int, ...] = (101, 102)  # the containers are planned on these
    plan_duration_s: float | None = None  # plan on the first D s (None: as the search)


FULL = {"sim": Search(None, 16.0, 0.04, 256.0, (1, 2, 3), (101, 102), 900.0),
        "mesh": Search(None, 1.0, 0.1, 32.0, None, (101, 102))}
QUICK = {"sim": Search(60.0, 8.0, 0.25, 64.0, (1,), (101,)), "mesh": Search(20.0, 1.0, 0.25, 32.0, None, (101,))}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smoke version of each part (minutes, not hours)")
    p.add_argument("--only", default=",".join(PARTS), help="parts to run: sim,emulated,real")
    p.add_argument("--out", default="docs/results", help="raw JSON and PNGs go here")
    p.add_argument("--md", default=None, help="results page (default: <out>.md)")
    p.add_argument("--readme", default=None,
                   help="README to update between the result markers ('' = none; default: README.md when --out is "
                        "the default docs/results, none otherwise, so a run kept elsewhere leaves the README alone)")
    p.add_argument("--jobs", type=positive_int, default=2, help="simulator points run in parallel")
    p.add_argument("--sim-duration-s", type=positive_float, default=None, help="replay only the first D s in the sim part")
    p.add_argument("--mesh-duration-s", type=positive_float, default=None, help="replay only the first D s on the meshes")
    p.add_argument("--tolerance", type=positive_float, default=None, help="bisection stop (hi/lo < 1 + tolerance)")
    p.add_argument("--start-scale", type=positive_float, default=None, help="first rate scale tried (default: per part)")
    p.add_argument("--sim-workloads", default=",".join(SIM_WORKLOADS))
    p.add_argument("--sim-cluster", default=SIM_CLUSTER)
    p.add_argument("--sim-policies", default=SIM_POLICIES)
    p.add_argument("--sim-seeds", type=seed_list, default=None, help="reporting arrival seeds of the sim part "
                                                                       "(default 1,2,3; --quick: 1)")
    p.add_argument("--deadline-chunks", type=name_list, default=(), metavar="POLICY[,POLICY...]",
                   help="these policies run with deadline-aware chunked prefill in every part that runs them (bench "
                        "compare --deadline-chunks; with container among them the partitions are planned with it)")
    p.add_argument("--step-cap", type=name_seconds, default={}, metavar="POLICY=S[,POLICY=S...]",
                   help="these policies cap each engine step at S seconds while sequences decode in every part that "
                        "runs them (bench compare --step-cap; with container among them the partitions are planned "
                        "with its cap)")
    for part in MESH_PARTS:
        p.add_argument(f"--{part}-runs", type=positive_int, default=None,
                       help=f"runs of the {part} part's search; the targets read their median (default 3; --quick: 1)")
    p.add_argument("--render-only", action="store_true", help="only re-render the pages from the JSON in --out")


def results_command(args: argparse.Namespace) -> str:
    """The ``slicesched bench results`` command line that reproduces this run (non-default options only)."""
    argv = ["slicesched", "bench", "results"] + (["--quick"] if args.quick else [])
    for flag, value, default in (("--only", args.only, ",".join(PARTS)), ("--out", args.out, "docs/results"),
                                 ("--md", args.md, None), ("--readme", args.readme, None),
                                 ("--jobs", args.jobs, 2), ("--sim-duration-s", args.sim_duration_s, None),
                                 ("--mesh-duration-s", args.mesh_duration_s, None),
                                 ("--tolerance", args.tolerance, None), ("--start-scale", args.start_scale, None),
                                 ("--sim-workloads", args.sim_workloads, ",".join(SIM_WORKLOADS)),
                                 ("--sim-cluster", args.sim_cluster, SIM_CLUSTER),
                                 ("--sim-policies", args.sim_policies, SIM_POLICIES),
                                 ("--sim-seeds", ",".join(map(str, args.sim_seeds)) if args.sim_seeds else None, None),
                                 ("--deadline-chunks", ",".join(getattr(args, "deadline_chunks", ())) or None, None),
                                 ("--step-cap", caps_text(getattr(args, "step_cap", None)) or None, None),
                                 *((f"--{m}-runs", getattr(args, f"{m}_runs", None), None) for m in MESH_PARTS)):
        if value != default:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(argv)


def caps_text(caps: dict[str, float] | None) -> str:
    """``--step-cap``'s text for ``caps`` (``container=0.04,slice=0.06``; empty for none)."""
    return ",".join(f"{p}={s:g}" for p, s in (caps or {}).items())


def search_for(args: argparse.Namespace, kind: str) -> Search:
    base = (QUICK if args.quick else FULL)[kind]
    dur = args.sim_duration_s if kind == "sim" else args.mesh_duration_s
    seeds = args.sim_seeds if kind == "sim" and args.sim_seeds else base.seeds
    return Search(dur if dur is not None else base.duration_s,
                  args.start_scale if args.start_scale is not None else base.start_scale,
                  args.tolerance if args.tolerance is not None else base.tolerance, base.max_scale, seeds,
                  base.tuning_seeds, base.plan_duration_s if dur is None else min(dur, base.plan_duration_s or dur))


def _compare_ns(workload: str, cluster: str, fidelity: str, s: Search, jobs: int,
                containers: Any = "plan", chunks: tuple[str, ...] = (), caps: dict[str, float] | None = None
                ) -> argparse.Namespace:
    return argparse.Namespace(workload=str(Path(workload).resolve()), cluster=str(Path(cluster).resolve()),
                              fidelity=fidelity, seed=None, seeds=s.seeds, tuning_seeds=s.tuning_seeds,
                              duration_s=s.duration_s, plan_duration_s=s.plan_duration_s, scale_mode=None,
                              start_scale=s.start_scale, tolerance=s.tolerance, max_scale=s.max_scale, jobs=jobs,
                              json_out=None, containers=containers, deadline_chunks=chunks, step_cap=caps or {})


def _full_duration(workload: str) -> float | None:
    d = (yaml.safe_load(Path(workload).read_text()) or {}).get("duration_s")
    return float(d) if isinstance(d, (int, float)) else None


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _check_png(path: Path | None) -> None:
    if path is not None and path.is_file() and path.stat().st_size > PNG_MAX_BYTES:
        print(f"slicesched bench results: warning: {path} is {path.stat().st_size // 1000} KB (> 150 KB)",
              file=sys.stderr)


def containers_option(containers: Any) -> str | None:
    """``--containers`` of the ``bench compare`` command equivalent to a part: a mode as given, or the mode of a
    partition resolved before the part ran (a mesh's, planned once for the mesh and its prediction: ``plan``
    reproduces it, where leaving the option out would run the tenants file's homes on a mesh)."""
    if isinstance(containers, str):
        return containers
    mode = containers.get("mode") if isinstance(containers, dict) else None
    return mode if mode in ("plan", "homes") else None


def compare_part(workload: str, cluster: str, policies: list[str], fidelity: str, s: Search, jobs: int,
                 json_out: Path, cmd: str, quick: bool, hook: Any = None,
                 containers: Any = "plan", chunks: tuple[str, ...] = (),
                 caps: dict[str, float] | None = None) -> dict[str, Any]:
    """One ``bench compare`` run, with its ``meta`` block, saved to ``json_out``; ``chunks``: the policies that
    prefill with deadline-aware chunks, ``caps``: the step cap of each policy named (those of them this part
    runs)."""
    from bench.bench_compare import compare
    from bench.results.meta import compare_command, describe_setup, run_meta
    chunks = tuple(p for p in chunks if p in policies)
    caps = {p: v for p, v in (caps or {}).items() if p in policies}
    ns = _compare_ns(workload, cluster, fidelity, s, jobs, containers, chunks, caps)
    if hook is not None:
        ns.mesh_hook = hook
    opts = {"duration_s": s.duration_s, "start_scale": s.start_scale, "tolerance": s.tolerance,
            "max_scale": s.max_scale, "jobs": jobs if fidelity == "sim" else None, "seeds": s.seeds,
            "tuning_seeds": s.tuning_seeds, "plan_duration_s": s.plan_duration_s,
            "containers": containers_option(containers), "deadline_chunks": chunks, "step_cap": caps}
    print(f"bench results: {fidelity} {Path(workload).stem}: {', '.join(policies)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = compare(ns, policies)
    res["workload"], res["cluster"] = _display(workload), _display(cluster)
    res["meta"] = run_meta(fidelity, command=compare_command(workload, cluster, policies, fidelity, json_out, opts),
                           results_command=cmd, wall_s=time.perf_counter() - t0, quick=quick,
                           duration_s=s.duration_s, full_duration_s=_full_duration(workload),
                           setup=describe_setup(workload, cluster, fidelity))
    _save(json_out, res)
    return res


def _display(path: str) -> str:
    from bench.results.meta import display_path
    return display_path(path)


def run_sim(args: argparse.Namespace, out: Path, cmd: str) -> None:
    s = search_for(args, "sim")
    policies = _split(args.sim_policies)
    for wl in map(_in_repo, _split(args.sim_workloads)):
        stem = Path(wl).stem
        compare_part(wl, _in_repo(args.sim_cluster), policies, "sim", s, args.jobs, out / f"sim-{stem}.json", cmd,
                     args.quick, chunks=getattr(args, "deadline_chunks", ()), caps=getattr(args, "step_cap", None))
        if {"container", "slice"} <= set(policies):  # where the violations are at slice's boundary
            anatomy_part(out / f"sim-{stem}.json", out / f"anatomy-{stem}.json")
        else:
            (out / f"anatomy-{stem}.json").unlink(missing_ok=True)


def anatomy_part(source: Path, json_out: Path) -> None:
    """``bench anatomy`` of container and slice at slice's ≤ 9% boundary of the compare result ``source``."""
    from bench.bench_anatomy import run as run_anatomy
    from bench.results.meta import display_path
    from shared.sim.anatomy import DEFAULT_BIN_S
    ns = argparse.Namespace(source=display_path(str(source)), policies="container,slice", bound="9", at="slice",
                            scale=None, own_boundary="container", bin_s=DEFAULT_BIN_S, json_out=str(json_out))
    if run_anatomy(ns) != 0:
        raise RuntimeError(f"bench anatomy of {source} failed")


def run_mesh(args: argparse.Namespace, out: Path, cmd: str, fidelity: str) -> None:
    """container vs slice on one mesh (recording slice's busy-time timeline); for the emulated mesh also the
    simulator's prediction for the same workload and cluster, with the same search settings."""
    from bench.bench_compare import resolve_containers
    from bench.results.timeline import TimelineRecorder
    wl, cluster = map(_in_repo, EMULATED if fidelity == "emulated" else REAL)
    s = search_for(args, "mesh")
    chunks = tuple(p for p in getattr(args, "deadline_chunks", ()) if p in MESH_POLICIES)
    caps = {p: v for p, v in (getattr(args, "step_cap", None) or {}).items() if p in MESH_POLICIES}
    planned = resolve_containers(_compare_ns(wl, cluster, "sim", s, 1, chunks=chunks, caps=caps))[1]  # mesh, prediction
    rec = TimelineRecorder(("slice",))
    res = compare_part(wl, cluster, list(MESH_POLICIES), fidelity, s, 1, out / f"{fidelity}.json", cmd, args.quick,
                       hook=rec, containers=planned, chunks=chunks, caps=caps)
    tl = rec.pick_busiest("slice")
    if tl is not None:
        per_point = sorted([s_, len(t["leases"]), t.get("violation_rate")] for (p, s_), t in rec.points.items()
                           if p == "slice")
        _save(out / f"{fidelity}-timeline.json", dict(tl, leases_per_point=per_point,
                                                      meta=dict(res["meta"], wall_s=None)))
    else:  # never leave an older run's timeline beside this run's numbers
        (out / f"{fidelity}-timeline.json").unlink(missing_ok=True)
        (out / f"{fidelity}-timeline.png").unlink(missing_ok=True)
        print(f"slicesched bench results: no {fidelity} timeline was recorded", file=sys.stderr)
    if fidelity == "emulated":  # predicted on the containers the mesh ran
        compare_part(wl, cluster, list(MESH_POLICIES), "sim", s, args.jobs, out / "emulated-prediction.json", cmd,
                     args.quick, containers=planned, chunks=chunks, caps=caps)
    # the same search again: one mesh run is a sample of the machine's speed at the hour
    from bench.results.render import repeat_files
    for old in repeat_files(out, fidelity):  # an earlier invocation's repeats never sit beside this run
        old.unlink()
    for i in range(2, mesh_runs(args, fidelity) + 1):
        compare_part(wl, cluster, list(MESH_POLICIES), fidelity, s, 1, out / f"{fidelity}-run{i}.json", cmd,
                     args.quick, containers=planned, chunks=chunks, caps=caps)


def mesh_runs(args: argparse.Namespace, part: str) -> int:
    """How many times a mesh part's search runs: ``--<part>-runs``, else 3 (1 with ``--quick``)."""
    n = getattr(args, f"{part}_runs", None)
    return n if n else (1 if args.quick else 3)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _in_repo(path: str) -> str:
    """A relative config path that is not found from here is taken from the repository root."""
    from bench.results.meta import REPO
    p = Path(path)
    return str(REPO / p) if not p.is_absolute() and not p.exists() and (REPO / p).exists() else path


def render(out: Path, md: Path, readme: Path | None, cmd: str | None) -> None:
    """Re-render docs/results.md and the README block from every JSON in ``out``."""
    from bench.results.render import (draw_figures, headline_markdown, load_results, results_markdown,
                                         update_readme, write_results_md)
    results = load_results(out)
    for png in draw_figures(results, out):
        _check_png(png)
    write_results_md(md, results_markdown(results, out, md, cmd))
    if readme is not None:
        import os
        update_readme(readme, headline_markdown(results, os.path.relpath(md, readme.parent)))


def _validate(args: argparse.Namespace, parts: list[str]) -> None:
    from shared.policies import POLICIES
    todo = []
    for flag, named in (("--deadline-chunks", getattr(args, "deadline_chunks", ())),
                        ("--step-cap", getattr(args, "step_cap", None) or {})):
        bad = [p for p in named if p not in POLICIES or getattr(POLICIES.get(p), "analytic", False)]
        if bad:
            raise ConfigError(flag, ",".join(bad), "unknown policy or an analytic bound (no engine)")
    if "sim" in parts:
        bad = [p for p in _split(args.sim_policies) if p not in POLICIES]
        if bad or not _split(args.sim_policies):
            raise ConfigError("--sim-policies", ",".join(bad) or "(none)", f"unknown policy; valid: "
                                                                            f"{', '.join(POLICIES.names())}")
        todo += [(w, args.sim_cluster) for w in _split(args.sim_workloads)]
    todo += [EMULATED] * ("emulated" in parts) + [REAL] * ("real" in parts)
    for wl, cluster in ((_in_repo(w), _in_repo(c)) for w, c in todo):
        load_cluster(cluster)
        if not Path(wl).is_file():
            raise ConfigError(wl, "(file)", "workload file not found")


def run(args: argparse.Namespace) -> int:
    parts = _split(args.only)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        print(f"slicesched bench results: unknown part {', '.join(bad) or '(none)'}; valid: {', '.join(PARTS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    if args.readme is None:
        args_readme = "README.md" if Path(args.out) == Path("docs/results") else ""
    else:
        args_readme = args.readme
    readme = Path(args_readme) if args_readme else None
    cmd = results_command(args)
    failed = []
    if not args.render_only:
        _validate(args, parts)
        for part in parts:
            t0 = time.perf_counter()
            try:
                run_sim(args, out, cmd) if part == "sim" else run_mesh(args, out, cmd, part)
            except ConfigError:
                raise
            except Exception as e:  # one broken part must not lose the others' results
                failed.append(part)
                print(f"slicesched bench results: part {part} failed: {e!r}", file=sys.stderr)
            print(f"bench results: part {part} took {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    render(out, md, readme, None if args.render_only else cmd)
    print(f"wrote {md}" + (f" and the results block of {readme}" if readme else ""))
    return 1 if failed else 0
