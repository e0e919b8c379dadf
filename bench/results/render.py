"""docs/results.md and the README headline from the raw result files (docs/results/*.json).

Each fidelity has its own tables and figures; every table is preceded by its fidelity label, machine, date and the
exact command. The acceptance targets of the evaluation are checked here from the numbers, never asserted.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

from bench.results.anatomy import anatomy_section, load_anatomies
from bench.results.checks import (bound_below, emulated_checks, read_ratio, real_checks, run_ratios, sim_checks,
                                  sim_summary_checks)
from shared.sim.metrics import MIN_TENANT_REQUESTS

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SIM_ORDER = ("azure-16mix-a0.7", "azure-16mix-a1.3", "azure-16mix-a2.1", "servegen-16mix")


def fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    """A number for a table, ``–`` when missing or not finite."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:{spec}}{suffix}"


def pct(x: Any) -> str:
    return fmt(None if x is None else 100 * x, ".1f", "%")


def yesno(v: bool | None) -> str:
    return "–" if v is None else ("yes" if v else "**no**")


def load_results(out_dir: Path) -> dict[str, Any]:
    """Every raw result in ``out_dir``: ``sim`` (workload stem → result), ``emulated``, ``prediction``, ``real``,
    and the timelines."""
    def read(name: str) -> dict[str, Any] | None:
        p = out_dir / name
        return json.loads(p.read_text()) if p.is_file() else None

    sims = {p.stem[len("sim-"):]: json.loads(p.read_text()) for p in sorted(out_dir.glob("sim-*.json"))}
    order = [w for w in SIM_ORDER if w in sims] + sorted(w for w in sims if w not in SIM_ORDER)
    return {"sim": {w: sims[w] for w in order}, "emulated": read("emulated.json"),
            "prediction": read("emulated-prediction.json"), "emulated_timeline": read("emulated-timeline.json"),
            "real": read("real.json"), "real_timeline": read("real-timeline.json"),
            **{f"{part}_repeats": [json.loads(p.read_text()) for p in repeat_files(out_dir, part)]
               for part in ("emulated", "real")},
            "anatomy": load_anatomies(out_dir, SIM_ORDER)}


def repeat_files(out_dir: Path, part: str) -> list[Path]:
    """``<part>-run2.json``, ``<part>-run3.json``, …: the part run again by the same ``bench results`` invocation
    (``--emulated-runs``, ``--real-runs``), in run order."""
    found = {p: p.stem[len(f"{part}-run"):] for p in out_dir.glob(f"{part}-run*.json")}
    return sorted((p for p, n in found.items() if n.isdigit()), key=lambda p: int(found[p]))


def _rel(png: Path, md: Path) -> str:
    return os.path.relpath(png, md.parent)


def provenance(meta: Mapping[str, Any]) -> list[str]:
    """The lines every table carries: fidelity, machine, date, command, trace window, wall time."""
    dur = meta.get("duration_s")
    full = meta.get("full_duration_s")
    if dur is None:
        window = f"the whole workload ({fmt(full, 'g')} s)" if full else "the whole workload"
    else:
        window = f"the first {fmt(dur, 'g')} s of the workload" + (f" (of {fmt(full, 'g')} s)" if full else "")
    tags = []
    if meta.get("quick"):
        tags.append("**quick smoke settings** (short runs, coarse search; not the acceptance measurement)")
    if meta.get("shortened"):
        tags.append("**shortened trace**")
    setup = ", ".join(x for x in (meta.get("devices"), f"{meta['tenants']} tenants" if meta.get("tenants") else None)
                      if x)
    lines = [f"- fidelity: **{meta['fidelity_label']}**" + (f"; {'; '.join(tags)}" if tags else ""),
             f"- setup: {setup or '–'}; workload `{meta.get('workload', '?')}`, cluster `{meta.get('cluster', '?')}`",
             f"- machine: {meta['machine']}; date: {meta['date']}"
             + (f"; commit: {meta['commit']}" if meta.get("commit") else "")
             + f"; wall time: {fmt(meta.get('wall_s'), '.0f')} s",
             f"- trace: {window}",
             f"- command: `{meta['command']}`"]
    return lines


def _leases(v: Any) -> str:
    if isinstance(v, Mapping):
        return fmt(v.get("granted"), ".0f")
    return fmt(v, ".0f") if isinstance(v, (int, float)) else "–"


def _range(r: Mapping[str, Any], key: str, spec: str) -> str:
    """`` [lo–hi]`` of a median figure over several seeds (empty for one seed)."""
    rng = r.get(f"{key}_range") if isinstance(r, Mapping) else None
    if not rng or rng[0] == rng[1]:
        return ""
    return f" [{fmt(rng[0], spec)}–{fmt(rng[1], spec)}]"


def policy_table(res: Mapping[str, Any]) -> list[str]:
    """Per policy (medians over the seeds, ranges in brackets): max scale and tokens/s at ≤ 9% and ≤ 1% violations,
    × container, share of pooled-bound's gain, the worst tenant there."""
    rat, cap = res.get("ratio_to_container", {}), res.get("pooled_gain_captured", {})
    bound = "pooled-bound" in res["policies"]  # the share of its gain only exists when the bound was run
    share = " share of pooled-bound gain |" if bound else ""
    lines = [f"| policy | max scale ≤9% | tok/s ≤9% | × container |{share} violations there | worst tenant there "
             f"| leases granted | max scale ≤1% | tok/s ≤1% | × container | worst tenant ≤1% |",
             "|---|" + "---:|" * (11 if bound else 10)]
    seeds = res.get("seeds") or [res.get("seed")]
    if len(seeds) > 1:
        lines[:0] = [f"Medians over the arrival seeds {', '.join(map(str, seeds))} (range in brackets); the worst "
                     "tenant is the worst over the seeds.", ""]
    if (res.get("confirm") or 1) > 1:
        lines[:0] = [f"Each reported point passed {res['confirm']} replays (`--confirm`): its violation rate is the worst "
                     "of them, its tokens/s their mean.", ""]
    for name, r in res["policies"].items():
        c9 = f" {pct(cap.get(name, {}).get('9'))} |" if bound else ""
        x9, x1 = rat.get(name, {}), rat.get(name, {})
        w9, w1 = r.get("worst_tenant_violation_rate_9"), r.get("worst_tenant_violation_rate_1")
        wt9 = "–" if name == "pooled-bound" else f"{r.get('worst_tenant_9') or '–'} {pct(w9)}"
        wt1 = "–" if name == "pooled-bound" else f"{r.get('worst_tenant_1') or '–'} {pct(w1)}"
        label = engine_label(name, res)
        lines.append(f"| {label} | {fmt(r['max_scale_9'], '.3g')}{_range(r, 'max_scale_9', '.3g')} | "
                     f"{fmt(r['tokens_per_s_9'], '.1f')} | {fmt(x9.get('9'))}{_range(x9, '9', '.2f')} |{c9} "
                     f"{pct(r.get('violation_rate'))} | {wt9} | {_leases(r.get('leases'))} | "
                     f"{fmt(r['max_scale_1'], '.3g')} | {fmt(r['tokens_per_s_1'], '.1f')} | "
                     f"{fmt(x1.get('1'))}{_range(x1, '1', '.2f')} | {wt1} |")
    return lines


def engine_label(name: str, res: Mapping[str, Any]) -> str:
    """``name`` with the engine options it ran with in ``res`` (deadline-aware chunks, a step cap)."""
    opts = (["deadline-aware chunks"] if name in (res.get("deadline_chunks") or ()) else []) + \
        ([f"steps ≤ {res['step_cap_s'][name]:g} s"] if (res.get("step_cap_s") or {}).get(name) else [])
    return f"{name} ({', '.join(opts)})" if opts else name


def containers_lines(res: Mapping[str, Any]) -> list[str]:
    """Which partition every policy started from."""
    c = res.get("containers") or {}
    if isinstance(c, str):  # a JSON written before containers were recorded as a mapping
        c = {"mode": c}
    mode = c.get("mode", "homes")
    if mode == "plan":
        dev = c.get("devices") or {}
        how = " with deadline-aware chunked prefill" if c.get("deadline_chunks") else ""
        how += f"{' and' if how else ' with'} steps capped at {c['step_cap_s']:g} s" if c.get("step_cap_s") else ""
        return [f"- containers: planned by `slicesched plan containers`{how} on arrival seeds "
                f"{', '.join(map(str, c.get('tuning_seeds') or []))} (not reported), every tenant within 9% up to rate "
                f"scale {fmt(c.get('planned_scale'), '.3g')} there; devices per tenant: "
                + ", ".join(f"{t} {n}" for t, n in dev.items())]
    if mode == "sized":
        return ["- containers: sized by average offered work (`container-avgwork`'s sizing)"]
    if mode == "file":
        return [f"- containers: from `{c.get('file')}`"]
    return ["- containers: the tenants file's home devices"]


def tenant_table(res: Mapping[str, Any], policies: tuple[str, ...] = ("container", "slice")) -> list[str]:
    """Per tenant: violation rate at each policy's ≤ 9% boundary, one figure per seed."""
    per = res.get("per_seed") or {}
    seeds = list(per)
    names = [p for p in policies if all(p in v["policies"] for v in per.values())]
    if not per or not names:
        return []
    tenants: list[str] = []
    for v in per.values():
        for p in names:
            for t in (v["policies"][p].get("tenants_9") or {}):
                if t not in tenants:
                    tenants.append(t)
    if not tenants:
        return []
    runs = ("the workload file's own arrivals, one replay per point" if seeds in (["None"], [None]) else
            "seeds " + ", ".join(map(str, seeds)))
    first = " for the first seed" if len(seeds) > 1 else ""
    lines = [f"Per tenant, violations at each policy's ≤ 9% point ({runs}; requests there in brackets{first}). "
             f"A tenant with fewer than {MIN_TENANT_REQUESTS} requests at a point counts in the aggregate only (the "
             "table's worst-tenant column skips it):", "",
             "| tenant | " + " | ".join(f"{p} ≤9%" for p in names) + " |", "|---|" + "---:|" * len(names)]
    for t in tenants:
        cells = []
        for p in names:
            vals = []
            for k, v in per.items():
                row = (v["policies"][p].get("tenants_9") or {}).get(t)
                vals.append("–" if row is None else f"{100 * row['violation_rate']:.1f}")
            first = (per[seeds[0]]["policies"][p].get("tenants_9") or {}).get(t)
            cells.append(" / ".join(vals) + "%" + (f" ({first['requests']})" if first else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines + [""]


def sim_section(sims: Mapping[str, Any], out_dir: Path, md: Path,
                anatomies: Mapping[str, Any] | None = None) -> list[str]:
    lines = ["## Simulated", "",
             "Offline simulator (H100 profile fitted to measured operator timings, docs/profiling.md); every policy on "
             "the same workload, cluster, seeds and planned containers in one run. SLA targets per request (5 × its "
             "own isolated TTFT and TPOT); load scaled by adding users (`superpose`). Max sustainable throughput = "
             "output tokens/s at the largest rate scale whose violations stay ≤ 9% (and ≤ 1%) in aggregate and for "
             "every tenant with ≥ 100 requests. `pooled-bound` is the analytic ceiling (a fluid, fully pooled "
             "cluster; `shared/sim/ceiling.py`), `pooled` a simulated free-weights pool (not a bound).", ""]
    if not sims:
        return lines + ["_Not run yet._", ""]
    summ = sim_summary_checks(sims)
    metas = [r["meta"] for r in sims.values()]
    lines += ["### Summary (simulated)", "",
              f"Fidelity **simulated**; {metas[0]['machine']}; {', '.join(sorted({m['date'] for m in metas}))}; "
              "produced by " + ", ".join(f"`{c}`" for c in dict.fromkeys(m["results_command"] for m in metas))
              + " (each workload's exact `bench compare` command is given below).", "",
              "| workload | slice × container ≤9% (median [range]) | ≤1% | slice's worst tenant ≤9% | slice's share of "
              "pooled-bound gain ≤9% | ahead of container-realloc, muxserve, token-pool ≤9% | planned container ÷ "
              "container-avgwork (scale ≤9%) |", "|---|---:|---:|---:|---:|---|---:|"]
    for w, res in sims.items():
        c = sim_checks(res)
        rng = c["ratio_9_range"]
        r = f"{fmt(c['ratio_9'])}" + (f" [{fmt(rng[0])}–{fmt(rng[1])}]" if rng and rng[0] != rng[1] else "")
        lines.append(f"| {w} | {r} | {fmt(c['ratio_1'])} | {pct(c['worst_tenant_9'])} | {pct(c['captured_9'])} | "
                     f"{yesno(c['ahead_9'])} | {fmt(c['planned_over_avgwork'])} |")
    lines += ["", "Targets (≤ 9%): " + "; ".join(f"{k}: {yesno(v)}" for k, v in summ.items()), ""]
    for w, res in sims.items():
        for key in ("9", "1"):
            above = bound_below(res, key)
            if above:
                lines += [f"Note: on {w} at ≤ {key}%, `pooled-bound` ({fmt(above[0][2], '.1f')} tok/s) is below "
                          + ", ".join(f"`{n}` ({fmt(t, '.1f')})" for n, t, _ in above)
                          + ": it is not an upper bound there, so shares of its gain are not meaningful.", ""]
    lines += anatomy_section({w: a for w, a in (anatomies or {}).items() if w in sims})
    for w, res in sims.items():
        lines += [f"### {w} (simulated)", ""] + provenance(res["meta"]) + containers_lines(res) + [""]
        lines += policy_table(res) + [""] + tenant_table(res)
        png = out_dir / f"sim-{w}.png"
        if png.is_file():
            lines += [f"![{w}: throughput and violations vs rate scale, simulated]({_rel(png, md)})", ""]
    return lines


NO_LEASE_NOTE = ("`slice` hosted no lease at any of its measured points within 9% violations here, so this ratio "
                 "is run-to-run variance, not leased slices (details in the results page).")


def lease_caveat(tl: Mapping[str, Any] | None, bound: float = 0.09) -> str | None:
    """A warning when ``slice`` hosted no lease at any of its search points within ``bound``: its ratio to
    container there cannot come from leased slices."""
    pts = (tl or {}).get("leases_per_point") or []
    ok = [n for _, n, v in pts if v is not None and v <= bound]
    if ok and not any(ok):
        return ("**Caution:** `slice` hosted no lease at any of its points within 9% violations (see the device "
                "busy time below), so its ratio to `container` here does not come from leased slices; it is "
                "run-to-run variance of this shared machine and of the short, coarse quick search.")
    return None


def _timeline_lines(tl: Mapping[str, Any] | None, png: Path, md: Path, label: str) -> list[str]:
    if not tl:
        return [f"_No {label} timeline recorded._", ""]
    lines = [f"Device busy time under `{tl['policy']}` at rate scale {fmt(tl['scale'], '.3g')} ({label}; "
             f"{fmt(tl.get('tokens_per_s'), '.1f')} tok/s, violations {pct(tl.get('violation_rate'))}): of the "
             "search's points within 9% violations, the one that hosted the most leases. Own work and "
             "guest-lane iterations are the workers' measured busy intervals; guest segments are measured per 0.5 s "
             "report window and drawn at the window's start; lease windows come from the lease messages."
             + (" On emulated devices `segments` leases run no separate guest iterations (the guest time a "
                "driver used while the guest had work delays the guest's next iterations instead, own or lane, "
                "which their busy intervals include), so only their lease windows show; `sequences` leases run "
                "emulated guest-lane iterations, drawn as guest work."
                if label == "emulated mesh" else ""), "",
             "| device (home tenant) | own work (s) | guest work (s) | lease windows hosted (s) | leases hosted |",
             "|---|---:|---:|---:|---:|"]
    if tl.get("leases_per_point"):
        lines[-2:-2] = ["Leases hosted at each `slice` point of the search (rate scale: lease windows, violations): "
                        + ", ".join(f"{fmt(sc, '.3g')}: {n} ({pct(v)})" for sc, n, v in tl["leases_per_point"])
                        + ".", ""]
    for d, b in tl.get("busy", {}).items():
        lines.append(f"| {d} ({tl['devices'].get(d, '?')}) | {fmt(b['own_s'], '.2f')} | {fmt(b['guest_s'], '.2f')} | "
                     f"{fmt(b['lease_window_s'], '.1f')} | {b['leases']} |")
    lines.append("")
    if png.is_file():
        lines += [f"![device busy-time timeline, {label}]({_rel(png, md)})", ""]
    return lines


def emulated_section(em: Mapping[str, Any] | None, pred: Mapping[str, Any] | None, tl: Mapping[str, Any] | None,
                     out_dir: Path, md: Path, repeats: list[Mapping[str, Any]] | None = None) -> list[str]:
    lines = ["## Emulated mesh", "",
             "Every real service (gateway, Redis, scheduler, GMG, simulator service, workers) with emulated devices: "
             "no tensor math, iteration time from the device profile, memory accounted. The simulator's prediction "
             "for the same workload and cluster, on the same containers (planned for the workload by "
             "`slicesched plan containers`), is shown beside the measurement, as a separate run and figure.", ""]
    if not em:
        return lines + ["_Not run yet._", ""]
    lines += ["### Measured (emulated mesh)", ""] + provenance(em["meta"]) + containers_lines(em) + [""]
    repeats = repeats or []
    lines += policy_table(em) + [""] + tenant_table(em) + (runs_table(em, repeats, "emulated") if repeats else [])
    if pred:
        lines += ["### Predicted (simulated, same workload, cluster and containers)", ""] + provenance(pred["meta"])
        lines += containers_lines(pred) + [""] + policy_table(pred) + [""]
        c = emulated_checks(em, pred, repeats)
        measured = f"median of {len(c['runs'])} runs" if repeats else "measured"
        lines += ["### Measured vs predicted", "",
                  f"| bound | slice ÷ container, emulated mesh ({measured}) | slice ÷ container, simulated (predicted) "
                  "| difference (measured − predicted) / predicted | same ordering |", "|---|---:|---:|---:|---|"]
        for key in ("9", "1"):
            lines.append(f"| ≤{key}% | {fmt(c[f'measured_{key}'])} | {fmt(c[f'predicted_{key}'])} | "
                         f"{pct(c[f'difference_{key}'])} | {yesno(c[f'same_order_{key}'])} |")
        lines += ["", f"Targets (≤ 9%): within 15% of the prediction: {yesno(c['within_15'])}; same ordering: "
                      f"{yesno(c['same_order_9'])}.", ""]
        if lease_caveat(tl):
            lines += [lease_caveat(tl), ""]
    for name, res, label in (("emulated", em, "emulated mesh"), ("emulated-prediction", pred, "simulated")):
        png = out_dir / f"{name}.png"
        if res and png.is_file():
            lines += [f"![throughput and violations vs rate scale, {label}]({_rel(png, md)})", ""]
    return lines + ["### Device busy time (emulated mesh)", ""] + _timeline_lines(
        tl, out_dir / "emulated-timeline.png", md, "emulated mesh")


def runs_table(first: Mapping[str, Any], repeats: list[Mapping[str, Any]], part: str) -> list[str]:
    """One row per run of a mesh part (the first is the one tabulated above), and the medians."""
    c = run_ratios(first, repeats)
    lines = [f"Runs of this search ({len(c['runs'])}; the first is the one tabulated above, `--{part}-runs` repeats "
             f"it in the same invocation; each row's command is in its JSON, `{part}-runN.json`). One mesh run is a "
             "sample of the machine's speed at the hour, so the target reads the median:", "",
             "| run | date | commit | container max scale ≤9% | slice max scale ≤9% | slice × container ≤9% | ≤1% |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for i, (res, (r9, r1)) in enumerate(zip((first, *repeats), c["runs"]), 1):
        m, p = res.get("meta", {}), res["policies"]
        lines.append(f"| {i} | {m.get('date', '–')} | {m.get('commit') or '–'} | "
                     f"{fmt(p.get('container', {}).get('max_scale_9'), '.3g')} | "
                     f"{fmt(p.get('slice', {}).get('max_scale_9'), '.3g')} | {fmt(r9)} | {fmt(r1)} |")
    return lines + [f"| median | | | | | **{fmt(c['median_9'])}** | {fmt(c['median_1'])} |", ""]


def real_section(real: Mapping[str, Any] | None, tl: Mapping[str, Any] | None, out_dir: Path,
                 md: Path, repeats: list[Mapping[str, Any]] | None = None) -> list[str]:
    lines = ["## Real CPU mesh", "",
             "The mesh computing for real with torch on this machine's CPU threads, under skewed, bursty load.", ""]
    if not real:
        return lines + ["_Not run yet._", ""]
    repeats = repeats or []
    c = real_checks(real, repeats)
    lines += provenance(real["meta"]) + containers_lines(real) + [""] + policy_table(real) + [""] + tenant_table(real)
    if repeats:
        lines += runs_table(real, repeats, "real")
    caveat = lease_caveat(tl)
    verdict = "**not met** (no lease ran, see below)" if caveat else yesno(c["meets"])
    read = (f"the median of {len(c['runs'])} runs, {fmt(c['median_9'])}×" if repeats else f"{fmt(c['ratio_9'])}×")
    lines += [f"Target: slice ≥ 1.3× container in measured tokens/s at ≤ 9% violations: {read} — {verdict}.", ""]
    if caveat:
        lines += [caveat, ""]
    png = out_dir / "real.png"
    if png.is_file():
        lines += [f"![throughput and violations vs rate scale, real CPU mesh]({_rel(png, md)})", ""]
    return lines + ["### Device busy time (real CPU mesh)", ""] + _timeline_lines(
        tl, out_dir / "real-timeline.png", md, "real CPU mesh")


def draw_figures(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Every PNG from the raw results: a rate sweep per run, a busy-time timeline per recorded mesh run; one
    fidelity per figure, named in its title."""
    from bench.results.plots import plot_sweep, plot_timeline

    def stem(r: Mapping[str, Any]) -> str:
        return Path(str(r.get("meta", {}).get("workload") or r.get("workload") or "workload")).stem

    todo = [(f"sim-{w}", r, f"{w} — simulated") for w, r in results["sim"].items()]
    for key, name, label in (("emulated", "emulated", "emulated mesh"),
                             ("prediction", "emulated-prediction", "simulated (prediction for the emulated mesh)"),
                             ("real", "real", "real CPU mesh")):
        if results[key]:
            todo.append((name, results[key], f"{stem(results[key])} — {label}"))
    paths = []
    for name, res, title in todo:
        p = plot_sweep(res, out_dir / f"{name}.png", title)
        if p is not None:
            paths.append(p)
    for key, name, label in (("emulated_timeline", "emulated-timeline", "emulated mesh"),
                             ("real_timeline", "real-timeline", "real CPU mesh")):
        tl = results[key]
        if tl and tl.get("devices"):
            paths.append(plot_timeline(tl, out_dir / f"{name}.png", f"{stem(tl)} under {tl.get('policy', '?')} at "
                                       f"rate scale {fmt(tl.get('scale'), '.3g')} — {label}: device busy time"))
    return paths


def _all_meta(results: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    parts = list(results["sim"].values()) + [results[k] for k in ("emulated", "prediction", "real")] \
        + list(results.get("emulated_repeats") or []) + list(results.get("real_repeats") or [])
    return [r["meta"] for r in parts if r and "meta" in r]


def results_markdown(results: Mapping[str, Any], out_dir: Path, md: Path, results_command: str | None = None) -> str:
    """The generated part of docs/results.md (the regenerate line lists the commands that produced the files,
    or ``results_command`` when none is recorded)."""
    walls = [(k, r["meta"]) for k, r in [*(("sim " + w, r) for w, r in results["sim"].items()),
                                         ("emulated mesh", results["emulated"]),
                                         *((f"emulated mesh, run {i}", r) for i, r in
                                           enumerate(results.get("emulated_repeats") or [], 2)),
                                         ("simulated prediction for the emulated mesh", results["prediction"]),
                                         ("real CPU mesh", results["real"]),
                                         *((f"real CPU mesh, run {i}", r) for i, r in
                                           enumerate(results.get("real_repeats") or [], 2))] if r]
    cmds = list(dict.fromkeys(m["results_command"] for m in _all_meta(results) if m.get("results_command")))
    cmds = cmds or ([results_command] if results_command else [])
    lines = ["Produced by: " + ", ".join(f"`{c}`" for c in cmds), "", "Measured wall time of each part in the run "
             "that produced these numbers:", ""]
    lines += [f"- {k}: {fmt(m.get('wall_s'), '.0f')} s ({'quick' if m.get('quick') else 'full settings'}"
              f"{', shortened trace' if m.get('shortened') else ''}; {m['date']})" for k, m in walls] + [""]
    lines += sim_section(results["sim"], out_dir, md, results.get("anatomy") or {})
    lines += emulated_section(results["emulated"], results["prediction"], results["emulated_timeline"], out_dir, md,
                              results.get("emulated_repeats"))
    lines += real_section(results["real"], results["real_timeline"], out_dir, md, results.get("real_repeats"))
    return "\n".join(lines).rstrip() + "\n"


def _setup(m: Mapping[str, Any], *extra: str) -> str:
    """``(devices, N tenants, …; machine; date[; quick settings][; first D s of the trace]; command)``."""
    what = ", ".join(x for x in (m.get("devices"), f"{m['tenants']} tenants" if m.get("tenants") else None, *extra)
                     if x)
    window = f"first {fmt(m.get('duration_s'), 'g')} s of the trace" if m.get("shortened") else ""
    tags = [x for x in (what, m["machine"], m["date"], "quick settings" if m.get("quick") else "", window,
                        f"`{m['results_command']}`" if m.get("results_command") else "") if x]
    return "(" + "; ".join(tags) + ")"


def headline_markdown(results: Mapping[str, Any], md_link: str) -> str:
    """The README's headline block: slice against container at each fidelity, one table per fidelity."""
    lines = [f"Regenerated by `slicesched bench results`; commands, plots and every policy: [{md_link}]({md_link}).",
             ""]
    sims = results["sim"]
    if sims:
        m = next(iter(sims.values()))["meta"]
        seeds = next(iter(sims.values())).get("seeds") or []
        chunks = sorted({p for r in sims.values() for p in r.get("deadline_chunks") or ()})
        how = f" ({', '.join(chunks)} prefilling with deadline-aware chunks)" if chunks else ""
        lines += [f"**Simulated** {_setup(m)}: token throughput at ≤ 9% / ≤ 1% SLA violations (per request, in "
                  f"aggregate and for every tenant), every policy on the same planned containers{how}; "
                  + (f"median over arrival seeds {', '.join(map(str, seeds))} [range]" if len(seeds) > 1 else
                     f"one arrival seed ({', '.join(map(str, seeds))}), no median"), "",
                  "| workload | slice × container ≤9% | ≤1% | slice's worst tenant ≤9% | share of pooled-bound gain "
                  "≤9% | best other baseline ≤9% |",
                  "|---|---:|---:|---:|---:|---|"]
        for w, res in sims.items():
            c = sim_checks(res)
            best = c["best_baseline"]
            rng = c["ratio_9_range"]
            r = f"{fmt(c['ratio_9'])}" + (f" [{fmt(rng[0])}–{fmt(rng[1])}]" if rng and rng[0] != rng[1] else "")
            lines.append(f"| {w} | {r} | {fmt(c['ratio_1'])} | {pct(c['worst_tenant_9'])} | {pct(c['captured_9'])} "
                         f"| {best[0] + ' ' + fmt(best[1]) + '×' if best else '–'} |")
        lines.append("")
    em, pred = results["emulated"], results["prediction"]
    if em:
        em_repeats = results.get("emulated_repeats") or []
        c = emulated_checks(em, pred, em_repeats) if pred else None
        runs = run_ratios(em, em_repeats)
        m = em["meta"]
        measured = f"median of {len(runs['runs'])} runs" if em_repeats else "measured"
        lines += [f"**Emulated mesh** {_setup(m)}", "",
                  f"| slice × container ≤9%, {measured} | simulator's prediction | difference | same ordering |",
                  "|---:|---:|---:|---|",
                  f"| {fmt(read_ratio(runs, '9'))} | {fmt(c['predicted_9']) if c else '–'} | "
                  f"{pct(c['difference_9']) if c else '–'} | {yesno(c['same_order_9']) if c else '–'} |", ""]
        if lease_caveat(results["emulated_timeline"]):
            lines += [NO_LEASE_NOTE, ""]
    real = results["real"]
    if real:
        m = real["meta"]
        p = real["policies"]
        repeats = results.get("real_repeats") or []
        c = real_checks(real, repeats)
        more = (" | median of runs |", "---:|", f" {fmt(c['median_9'])} ({len(c['runs'])} runs) |") if repeats \
            else ("", "", "")
        lines += [f"**Real CPU mesh** {_setup(m, 'bursty load')}", "",
                  "| container tok/s ≤9% | slice tok/s ≤9% | slice × container" + (more[0] or " |"),
                  "|---:|---:|---:|" + more[1],
                  f"| {fmt(p.get('container', {}).get('tokens_per_s_9'), '.1f')} | "
                  f"{fmt(p.get('slice', {}).get('tokens_per_s_9'), '.1f')} | {fmt(c['ratio_9'])} |" + more[2], ""]
        if lease_caveat(results["real_timeline"]):
            lines += [NO_LEASE_NOTE, ""]
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, block: str, *, heading: str = "## Results") -> str:
    """``text`` with what lies between the markers replaced by ``block``; the markers are added (under
    ``heading``, appended when missing) the first time. Nothing outside the markers changes."""
    begin = re.search(rf"^{re.escape(BEGIN)}[ \t]*$", text, re.M)  # a marker is a line of its own, never prose
    end = re.search(rf"^{re.escape(END)}[ \t]*$", text[begin.end():], re.M) if begin else None
    if begin and end:
        return text[:begin.end()] + "\n" + block.rstrip("\n") + "\n" + text[begin.end() + end.start():]
    new = f"{BEGIN}\n{block.rstrip(chr(10))}\n{END}\n"
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == heading:
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            return "".join(lines[:i + 1]) + "\n" + new + ("\n" if j < len(lines) else "") + "".join(lines[j:])
    sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    return text + sep + f"{heading}\n\n" + new


DEFAULT_HEADER = """# Results

Throughput of SliceScheduler against the baselines at three fidelities, each reported on its own: the offline
simulator at cluster scale (simulated), the real mesh with emulated devices (emulated mesh), and the real mesh
computing on this machine's CPU (real CPU mesh). Definitions (DESIGN §9): token throughput = output tokens of
completed requests per second; a request violates its SLA when its TTFT or TPOT exceeds its tenant's target or it
is rejected or fails; max sustainable throughput is read at the largest arrival-rate scale with violations ≤ 9%
(and ≤ 1%), found by bracketing and bisection (`slicesched bench compare`).

Everything below the marker is generated by `slicesched bench results`; raw JSON and PNGs are in `docs/results/`.
"""


def write_results_md(md: Path, generated: str) -> None:
    """docs/results.md: the hand-written header (kept when present) and the generated block."""
    text = md.read_text() if md.is_file() else DEFAULT_HEADER
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(replace_block(text, generated, heading="## Generated results"))


def update_readme(readme: Path, block: str) -> None:
    """Replace only what lies between the README's result markers (adding them under ``## Results`` once)."""
    readme.write_text(replace_block(readme.read_text() if readme.is_file() else "", block))
