"""Prediction-error metrics of the simulator against measurements (DESIGN §9), as pure functions.

* Segment latency: the predicted mean of each (segment, tokens bucket) against the measured mean of that bucket
  (single executions scatter too much on a shared CPU to compare one by one), with the per-execution spread and
  the standard error of the measured mean beside it.
* Requests: absolute percentage error of each request's TTFT and TPOT, summarised by its median and p90, and the
  error of the distribution's median and p90 themselves.
* Memory over time: at each measured sample, |predicted − measured| bytes as a fraction of device capacity.
* Noise floor of the request errors: what the best predictor that cannot tell identical work apart would score.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np


def ape(predicted: float, measured: float) -> float:
    """Absolute percentage error |predicted − measured| / measured as a fraction (measured must be > 0)."""
    if not measured > 0:
        raise ValueError(f"measured value must be positive, got {measured!r}")
    return abs(predicted - measured) / measured


def mape(pairs: Iterable[tuple[float, float]]) -> float:
    """Mean of :func:`ape` over (predicted, measured) pairs; nan for none."""
    errs = [ape(p, m) for p, m in pairs]
    return float(np.mean(errs)) if errs else math.nan


def ape_quantiles(pairs: Iterable[tuple[float, float]], qs: Sequence[float] = (50, 90)) -> dict[str, float]:
    """Quantiles (``p50``, ``p90`` …) of the per-item APE; nan for no items."""
    errs = [ape(p, m) for p, m in pairs]
    if not errs:
        return {f"p{q:g}": math.nan for q in qs}
    return {f"p{q:g}": float(np.percentile(errs, q)) for q in qs}


def quantile_errors(predicted: Sequence[float], measured: Sequence[float],
                    qs: Sequence[float] = (50, 90)) -> dict[str, float]:
    """APE of each quantile of the predicted distribution against the same quantile measured."""
    if not len(predicted) or not len(measured):
        return {f"p{q:g}": math.nan for q in qs}
    return {f"p{q:g}": ape(float(np.percentile(predicted, q)), float(np.percentile(measured, q))) for q in qs}


@dataclass(frozen=True)
class BucketStats:
    """Executions of one (segment, bucket): count, sum and sum of squares of their times (any unit)."""

    count: int
    total: float
    sumsq: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        """Per-execution standard deviation (sample, from the sums)."""
        if self.count < 2:
            return 0.0
        var = max(0.0, self.sumsq / self.count - self.mean ** 2)
        return math.sqrt(var * self.count / (self.count - 1))

    @property
    def cv(self) -> float:
        """Per-execution spread: std / mean."""
        return self.std / self.mean if self.count and self.mean > 0 else math.nan

    @property
    def rel_se(self) -> float:
        """Standard error of the mean, relative to the mean."""
        return self.cv / math.sqrt(self.count) if self.count else math.nan

    def __add__(self, other: "BucketStats") -> "BucketStats":
        return BucketStats(self.count + other.count, self.total + other.total, self.sumsq + other.sumsq)


def segment_errors(measured: Mapping[tuple, BucketStats], predicted: Mapping[tuple, BucketStats],
                   min_count: int = 1) -> tuple[list[dict], dict[str, float]]:
    """Per-key rows and a summary of predicted bucket means against measured bucket means.

    Keys present on both sides with at least ``min_count`` measured executions are scored. The summary gives
    ``mape`` (unweighted over keys), ``weighted_mape`` (weighted by measured time, i.e. count × mean),
    ``noise_floor`` (the MAPE a perfect predictor would show from the measured means' standard errors alone,
    √(2/π)·SE averaged over keys) and ``keys``.
    """
    rows = []
    try:
        keys = sorted(measured)
    except TypeError:  # keys of mixed shapes
        keys = sorted(measured, key=str)
    for key in keys:
        m = measured[key]
        p = predicted.get(key)
        if p is None or not p.count or m.count < min_count or not m.mean > 0:
            continue
        rows.append({"key": key, "count": m.count, "measured": m.mean, "predicted": p.mean,
                     "error": (p.mean - m.mean) / m.mean, "cv": m.cv, "rel_se": m.rel_se, "predicted_count": p.count})
    if not rows:
        return rows, {"mape": math.nan, "weighted_mape": math.nan, "noise_floor": math.nan, "keys": 0}
    errs = np.array([abs(r["error"]) for r in rows])
    wts = np.array([r["count"] * r["measured"] for r in rows])
    floor = float(np.mean([math.sqrt(2 / math.pi) * r["rel_se"] for r in rows]))
    return rows, {"mape": float(errs.mean()), "weighted_mape": float((errs * wts).sum() / wts.sum()),
                  "noise_floor": floor, "keys": len(rows)}


def value_at(timeline: Sequence[tuple[float, float]], t: float) -> float:
    """Value of a step function given as time-sorted (time, value) change points, at time ``t``
    (the last change at or before ``t``; the first value before the first change)."""
    if not timeline:
        return 0.0
    i = bisect.bisect_right([p[0] for p in timeline], t) - 1
    return float(timeline[max(0, i)][1])


def memory_timeline_error(predicted: Sequence[tuple[float, float]], samples: Sequence[tuple[float, float]],
                          capacity: float) -> dict[str, float]:
    """|predicted(t) − measured(t)| / capacity at every measured sample (t, bytes): mean, p90, max (fractions)."""
    if not capacity > 0:
        raise ValueError(f"capacity must be positive, got {capacity!r}")
    if not samples:
        return {"mean": math.nan, "p90": math.nan, "max": math.nan, "samples": 0}
    times = [p[0] for p in predicted]
    errs = []
    for t, b in samples:
        i = bisect.bisect_right(times, t) - 1
        pred = predicted[max(0, i)][1] if predicted else 0.0
        errs.append(abs(pred - b) / capacity)
    a = np.array(errs)
    return {"mean": float(a.mean()), "p90": float(np.percentile(a, 90)), "max": float(a.max()), "samples": len(a)}


def constant_floor(groups: Iterable[Sequence[float]], min_size: int = 5) -> dict[str, float]:
    """The median APE of the best predictor that gives every member of a group one value: each group (values
    measured for identical work) is predicted by the constant that minimises that group's median APE (exactly),
    and the per-item APEs of all groups with at least ``min_size`` members are pooled. A predictor that gives identical
    work one value can hardly score below it: what is left is the run's timing noise, not a model error.
    Returns ``median`` (nan for no group), ``items`` and ``groups`` scored."""
    errs: list[float] = []
    n = 0
    for g in groups:
        vals = [float(v) for v in g if v > 0]
        if len(vals) < min_size:
            continue
        n += 1
        v = np.array(vals)
        # the median of the piecewise-linear |c − y|/y is lowest where one of them is 0 or two are equal
        # ((c − a)/a = (b − c)/b at c = 2ab/(a + b)): every such point is a candidate, so the minimum is exact
        cands = np.concatenate([v, (2 * np.outer(v, v) / np.add.outer(v, v)).ravel()])
        e = np.abs(v[None, :] - cands[:, None]) / v[None, :]
        errs.extend(e[int(np.argmin(np.median(e, axis=1)))].tolist())
    return {"median": float(np.median(errs)) if errs else math.nan, "items": len(errs), "groups": n}
