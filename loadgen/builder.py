"""Workload authoring: writing workload files from command-line choices (``loadgen workload build``) and
summarising what a workload offers (``loadgen workload show``): per-tenant requests, rate, mean lengths and
burstiness."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadgen.traces import default_traces_dir, guess_format
from shared.config import ConfigError
from shared.workload import Workload


@dataclass(frozen=True)
class TraceChoice:
    """A ``--trace`` with its format and options as given on the command line."""

    path: str
    format: str | None = None
    columns: dict[str, str] | None = None
    time_unit: str = "s"
    servegen_model: str = "m-large"
    servegen_clients: int = 16
    servegen_start_s: float = 0.0
    servegen_span_s: float | None = None


def portable_path(path: str | Path, out_dir: Path, env: dict[str, str] | None = None) -> str:
    """``${SLICESCHED_TRACES}/…`` for files in the traces folder, else a path relative to the workload file."""
    e = os.environ if env is None else env
    p = Path(path).resolve()
    traces = Path(e.get("SLICESCHED_TRACES") or default_traces_dir()).resolve()
    try:
        return "${SLICESCHED_TRACES}/" + p.relative_to(traces).as_posix()
    except ValueError:
        return os.path.relpath(p, out_dir.resolve())


def workload_document(out: Path, traces: list[TraceChoice], tenants: str | Path, alpha: float | None, seed: int,
                      duration_s: float, rate_scale: float = 1.0, cluster: str | Path | None = None,
                      base_rate_rps: float | None = None, max_input_tokens: int | None = None,
                      max_output_tokens: int | None = None, name: str | None = None) -> dict[str, Any]:
    """The YAML document for a workload file at ``out`` (paths made relative to it)."""
    if not traces:
        raise ConfigError("--trace", "(arguments)", "give at least one --trace")
    out_dir = out.parent
    entries = []
    for t in traces:
        if not Path(t.path).is_file():
            raise ConfigError(t.path, "(file)", "file not found")
        fmt = t.format or guess_format(t.path)
        e: dict[str, Any] = {"path": portable_path(t.path, out_dir), "format": fmt}
        if fmt == "csv":
            if not t.columns:
                raise ConfigError(t.path, "--columns", "format csv needs --columns time=C,input=C,output=C")
            e["columns"] = dict(t.columns)
            e["time_unit"] = t.time_unit
        if fmt == "servegen":
            e.update(model=t.servegen_model, clients=t.servegen_clients, start_s=t.servegen_start_s)
            if t.servegen_span_s:
                e["span_s"] = t.servegen_span_s
        entries.append(e)
    doc: dict[str, Any] = {"name": name or out.name.removesuffix(".yaml").removesuffix(".yml"),
                           "tenants": os.path.relpath(Path(tenants).resolve(), out_dir.resolve())}
    if cluster:
        doc["cluster"] = os.path.relpath(Path(cluster).resolve(), out_dir.resolve())
    doc.update(traces=entries, alpha="native" if alpha is None else alpha, seed=seed, duration_s=duration_s,
               rate_scale=rate_scale, offsets="auto")
    if base_rate_rps is not None:
        doc["base_rate_rps"] = base_rate_rps
    caps = {k: v for k, v in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)) if v}
    if caps:
        doc["caps"] = caps
    return doc


def write_workload_file(out: Path, doc: dict[str, Any]) -> None:
    """Write the document with a header saying how to read it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = ("# SliceScheduler workload file (format: docs/loadgen.md). Written by `loadgen workload build`.\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110))
    out.write_text(text)


def burstiness_cv(times_s: np.ndarray, duration_s: float, window_s: float = 1.0) -> float | None:
    """Coefficient of variation of arrival counts over consecutive windows covering [0, duration_s)."""
    bins = max(1, math.ceil(duration_s / window_s))
    if times_s.size == 0:
        return None
    counts = np.bincount(np.minimum((times_s / window_s).astype(np.int64), bins - 1), minlength=bins)
    mean = counts.mean()
    return float(counts.std() / mean) if mean > 0 else None


def workload_stats(w: Workload) -> dict[str, Any]:
    """Per tenant (file order) and total: requests, rate_rps, mean input/output tokens, 1-s burstiness CV."""
    names = w.tenants.names()
    by: dict[str, list] = {n: [] for n in names}
    for r in w.requests:
        by.setdefault(r.tenant, []).append(r)

    def stats(reqs: list) -> dict[str, Any]:
        t = np.fromiter((r.arrival_s for r in reqs), dtype=np.float64, count=len(reqs))
        inp = np.fromiter((r.input_tokens for r in reqs), dtype=np.float64, count=len(reqs))
        out = np.fromiter((r.output_tokens for r in reqs), dtype=np.float64, count=len(reqs))
        return {"requests": len(reqs), "rate_rps": len(reqs) / w.duration_s,
                "mean_input_tokens": float(inp.mean()) if reqs else None,
                "mean_output_tokens": float(out.mean()) if reqs else None,
                "offered_output_tok_s": float(out.sum()) / w.duration_s,
                "cv_1s": burstiness_cv(t, w.duration_s)}

    per = {n: stats(rs) for n, rs in by.items()}
    for n, s in per.items():
        plan = w.meta.get("tenants", {}).get(n, {})
        s["trace"] = plan.get("trace")
    return {"name": w.name, "source": w.source, "duration_s": w.duration_s, "rate_scale": w.rate_scale,
            "seed": w.seed, "alpha": w.meta.get("alpha"), "tenants": per, "total": stats(list(w.requests))}


def format_stats(stats: dict[str, Any]) -> str:
    """A plain-text table of :func:`workload_stats`."""
    def f(v: float | None, nd: int = 1) -> str:
        return "-" if v is None else f"{v:.{nd}f}"

    head = f"{'tenant':<16} {'requests':>9} {'rate/s':>8} {'in':>7} {'out':>6} {'out tok/s':>10} {'cv_1s':>6}  trace"
    lines = [f"workload {stats['name']} ({stats['source']}): {stats['duration_s']:g} s, rate_scale "
             f"{stats['rate_scale']:g}, alpha {stats['alpha']}, seed {stats['seed']}", head, "-" * len(head)]
    rows = list(stats["tenants"].items()) + [("total", stats["total"])]
    for name, s in rows:
        lines.append(f"{name:<16} {s['requests']:>9} {s['rate_rps']:>8.3f} {f(s['mean_input_tokens'], 0):>7} "
                     f"{f(s['mean_output_tokens'], 0):>6} {s['offered_output_tok_s']:>10.1f} {f(s['cv_1s'], 2):>6}"
                     f"  {s.get('trace') or ''}")
    return "\n".join(lines)
