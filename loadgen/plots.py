"""PNG plots for results (matplotlib, Agg backend): rate sweeps per policy and device busy-time timelines."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def save_figure(fig, path: str | Path, dpi: int = 90) -> Path:
    """Lay out ``fig``, write it to ``path`` (parents created) and close it; returns the path."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out

SweepPoint = tuple[float, float, float]  # (rate_scale, tokens_per_s, violation_rate)
Interval = tuple[str, float, float, str]  # (device, start_s, end_s, label)


def plot_rate_sweep(results: Mapping[str, Sequence[SweepPoint]], path: str | Path, *, title: str = "",
                    bounds: Sequence[float] = (0.09, 0.01)) -> Path:
    """Token throughput and SLA violation rate against rate scale, one line per policy; ``bounds`` are drawn
    as horizontal lines on the violation panel."""
    if not results:
        raise ValueError("no results to plot")
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, pts in results.items():
        pts = sorted(pts)
        xs = [p[0] for p in pts]
        ax_t.plot(xs, [p[1] for p in pts], marker="o", label=policy)
        ax_v.plot(xs, [100 * p[2] for p in pts], marker="o", label=policy)
    for b in bounds:
        ax_v.axhline(100 * b, color="grey", linestyle="--", linewidth=0.8)
        ax_v.annotate(f"{100 * b:g}%", xy=(0, 100 * b), xycoords=("axes fraction", "data"), fontsize=8,
                      color="grey", va="bottom")
    ax_t.set(xlabel="rate scale", ylabel="token throughput (tok/s)", title="throughput")
    ax_v.set(xlabel="rate scale", ylabel="SLA violations (%)", title="violations")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def plot_device_timeline(intervals: Sequence[Interval], path: str | Path, *, title: str = "",
                         colors: Mapping[str, str] | None = None) -> Path:
    """One row per device, a bar per busy interval coloured by label (e.g. the tenant, or ``guest:<tenant>``
    for slices lent to another tenant)."""
    if not intervals:
        raise ValueError("no intervals to plot")
    devices = sorted({d for d, *_ in intervals})
    labels = sorted({lab for *_, lab in intervals})
    cmap = plt.get_cmap("tab20")
    palette = {lab: (colors or {}).get(lab, cmap(i % 20)) for i, lab in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(devices) + 1.5))
    for row, dev in enumerate(devices):
        for lab in labels:
            spans = [(s, e - s) for d, s, e, lb in intervals if d == dev and lb == lab and e > s]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=palette[lab])
    ax.set_yticks(range(len(devices)), devices)
    ax.invert_yaxis()  # first device on top
    ax.set_xlabel("time (s)")
    ax.set_title(title or "device busy time")
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette[lab]) for lab in labels]
    ax.legend(handles, labels, fontsize=7, ncol=min(6, len(labels)), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(devices) < 4 else -0.12))
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path, dpi=110)
