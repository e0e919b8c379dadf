"""What a workload offers: per-tenant requests, rate, mean lengths and burstiness (for ``workload show``)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from shared.workload import Workload


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
