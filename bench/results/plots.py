"""PNG figures of the results: one fidelity per figure, its label in the title."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from loadgen.plots import save_figure  # noqa: E402


OWN_COLOR = "#4c72b0"
LEASE_ALPHA = 0.35


def sweep_points(result: Mapping[str, Any]) -> dict[str, list[tuple[float, float, float]]]:
    """``bench compare``'s ``runs`` of its first seed as (rate_scale, tokens_per_s, worst of the aggregate and
    per-tenant violation rates) per policy, in policy order; points stopped early (a proven failure whose figures
    cover part of the run) are left out."""
    seeds = result.get("seeds") or [None]
    first = seeds[0]
    out: dict[str, list[tuple[float, float, float]]] = {p: [] for p in result.get("policies", {})}
    for r in result.get("runs", []):
        if r.get("seed", first) != first or r.get("stopped_early"):
            continue
        v = max(r["violation_rate"], r.get("worst_tenant_violation_rate") or 0.0)
        out.setdefault(r["policy"], []).append((r["scale"], r["tokens_per_s"], v))
    return {p: sorted(v) for p, v in out.items() if v}


def plot_sweep(result: Mapping[str, Any], path: str | Path, title: str,
               bounds: tuple[float, ...] = (0.09, 0.01)) -> Path | None:
    """Token throughput and SLA violations vs rate scale (log axis), one line per policy, a star at each
    policy's max sustainable point (≤ 9%); None when the result has no runs."""
    pts = sweep_points(result)
    if not pts:
        return None
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (policy, xs) in enumerate(pts.items()):
        color = plt.get_cmap("tab10")(i % 10)
        scales = [p[0] for p in xs]
        ax_t.plot(scales, [p[1] for p in xs], marker="o", markersize=3, color=color, label=policy)
        ax_v.plot(scales, [100 * p[2] for p in xs], marker="o", markersize=3, color=color, label=policy)
        best = result.get("policies", {}).get(policy, {})
        if best.get("max_scale_9"):
            ax_t.plot([best["max_scale_9"]], [best["tokens_per_s_9"]], marker="*", markersize=12, color=color,
                      markeredgecolor="black", linestyle="none")
    for b in bounds:
        ax_v.axhline(100 * b, color="grey", linestyle="--", linewidth=0.8)
        ax_v.annotate(f"{100 * b:g}%", xy=(1.0, 100 * b), xycoords=("axes fraction", "data"), fontsize=8,
                      color="grey", ha="right", va="bottom")
    ax_t.set(xlabel="rate scale (log)", ylabel="token throughput (tok/s)",
             title="throughput (★ = max sustainable at ≤ 9%)")
    seeds = result.get("seeds") or [None]
    ax_v.set(xlabel="rate scale (log)", ylabel="SLA violations, worst of total and tenants (%)",
             title="violations" + (f" (seed {seeds[0]})" if seeds[0] is not None else ""))
    for ax in (ax_t, ax_v):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_timeline(tl: Mapping[str, Any], path: str | Path, title: str) -> Path:
    """One row per device: its own tenant's iterations, guest work (lane iterations; per-window guest segment
    totals drawn at the window's start) in the guest tenant's colour, and lease windows as a strip below."""
    devices = list(tl["devices"])
    if not devices:
        raise ValueError("timeline has no devices")
    row = {d: i for i, d in enumerate(devices)}
    guests = sorted({x[3] for x in tl["guest"]} | {x[3] for x in tl["guest_segments"]} | {x[2] for x in tl["leases"]})
    cmap = plt.get_cmap("tab10")
    colors = {tn: cmap((i + 1) % 10) for i, tn in enumerate(guests)}
    fig, ax = plt.subplots(figsize=(11, max(2.4, 0.5 * len(devices) + 1.4)))
    for dev in devices:
        y = row[dev]
        own = [(a, b - a) for d, a, b, _ in tl["own"] if d == dev]
        if own:
            ax.broken_barh(own, (y - 0.38, 0.56), facecolors=OWN_COLOR, linewidth=0)
        for tn in guests:
            spans = [(a, b - a) for d, a, b, t in tl["guest"] if d == dev and t == tn]
            spans += [(a, min(ms / 1000.0, b - a)) for d, a, b, t, ms in tl["guest_segments"] if d == dev and t == tn]
            if spans:
                ax.broken_barh(spans, (y - 0.38, 0.56), facecolors=colors[tn], linewidth=0)
            lz = [(a, b - a) for g, _, t, a, b, *_ in tl["leases"] if g == dev and t == tn]
            if lz:
                ax.broken_barh(lz, (y + 0.22, 0.16), facecolors=colors[tn], alpha=LEASE_ALPHA, linewidth=0)
    ax.set_yticks(range(len(devices)), [f"{d} ({tl['devices'][d]})" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first request (s)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=OWN_COLOR)]
    labels = ["own tenant's work"]
    worked = {x[3] for x in tl["guest"]} | {x[3] for x in tl["guest_segments"]}
    leased = {x[2] for x in tl["leases"]}
    for tn in guests:
        if tn in worked:
            handles.append(plt.Rectangle((0, 0), 1, 1, color=colors[tn]))
            labels.append(f"guest work: {tn}")
        if tn in leased:
            handles.append(plt.Rectangle((0, 0), 1, 1, color=colors[tn], alpha=LEASE_ALPHA))
            labels.append(f"lease window: {tn}")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path)
