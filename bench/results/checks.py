"""The evaluation's acceptance targets, read off ``bench compare`` results (never assumed)."""
from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from bench.bench_compare import captured, ratios

BASELINES = ("container-realloc", "muxserve", "token-pool")
SIM_RATIO_AZURE, SIM_RATIO_SERVEGEN, SIM_RATIO_ONE, SIM_CAPTURED_MIN = 1.5, 1.10, 2.29, 0.70
PLANNED_OVER_AVGWORK = 2.0  # the planned partition lets container sustain this many times avgwork's scale
PLANNED_CHECKED_ON = "a1.3"  # ... on this workload (the yardstick's acceptance; the other ratios are shown)
EMULATED_MAX_DIFF = 0.15
REAL_RATIO_MIN = 1.3


def _get(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def sim_checks(res: Mapping[str, Any]) -> dict[str, Any]:
    """slice's ratio to container and share of pooled-bound's gain at both bounds, whether slice is ahead of
    each other baseline at ≤ 9%, and the best policy other than slice and the bound."""
    pol = res["policies"]
    rat = res.get("ratio_to_container") or ratios(pol)
    cap = res.get("pooled_gain_captured") or captured(pol)
    s9 = _get(pol, "slice", "tokens_per_s_9")
    present = [b for b in BASELINES if b in pol]
    ahead = None if s9 is None or not present else all(s9 > pol[b]["tokens_per_s_9"] for b in present)
    others = [(n, _get(rat, n, "9")) for n in pol if n not in ("slice", "pooled-bound", "pooled")]
    others = [(n, r) for n, r in others if r is not None]
    beaten = {k for k in ("9", "1") if any(n == "slice" for n, _, _ in bound_below(res, k))}
    avg = _get(pol, "container-avgwork", "max_scale_9")
    planned = _get(pol, "container", "max_scale_9")
    return {"ratio_9": _get(rat, "slice", "9"), "ratio_1": _get(rat, "slice", "1"),
            "ratio_9_range": _get(rat, "slice", "9_range"),
            "worst_tenant_9": _get(pol, "slice", "worst_tenant_violation_rate_9"),
            "container_worst_tenant_9": _get(pol, "container", "worst_tenant_violation_rate_9"),
            "planned_over_avgwork": planned / avg if planned and avg else None,
            # no share where slice beats the bound: it is no upper bound there (the note says so)
            "captured_9": None if "9" in beaten else _get(cap, "slice", "9"),
            "captured_1": None if "1" in beaten else _get(cap, "slice", "1"),
            "above_bound_9": "9" in beaten,
            "ahead_9": ahead, "ahead_of": {b: (s9 > pol[b]["tokens_per_s_9"]) if s9 is not None else None
                                           for b in present},
            "best_baseline": max(others, key=lambda x: x[1]) if others else None}


def _all(values: list[Any], pred) -> bool | None:
    """False as soon as one known value fails; None when some are unknown and none fails."""
    if any(v is not None and not pred(v) for v in values):
        return False
    if not values or any(v is None for v in values):
        return None
    return True


def bound_below(res: Mapping[str, Any], key: str = "9") -> list[tuple[str, float, float]]:
    """Policies that beat ``pooled-bound`` (name, their tok/s, the bound's): where it is no upper bound."""
    pol = res["policies"]
    if "pooled-bound" not in pol:
        return []
    b = pol["pooled-bound"][f"tokens_per_s_{key}"]
    return [(n, r[f"tokens_per_s_{key}"], b) for n, r in pol.items()
            if n != "pooled-bound" and r[f"tokens_per_s_{key}"] > b]


def sim_summary_checks(sims: Mapping[str, Mapping[str, Any]]) -> dict[str, bool | None]:
    """The offline targets over every workload (None when a number is missing)."""
    cs = {w: sim_checks(r) for w, r in sims.items()}
    azure = [c["ratio_9"] for w, c in cs.items() if w.startswith("azure")]
    servegen = [c["ratio_9"] for w, c in cs.items() if w.startswith("servegen")]
    return {
        f"slice ≥ {SIM_RATIO_AZURE:.2f}× container on every Azure α": _all(azure, lambda v: v >= SIM_RATIO_AZURE),
        f"slice ≥ {SIM_RATIO_SERVEGEN:.2f}× container on ServeGen": _all(servegen, lambda v: v >= SIM_RATIO_SERVEGEN),
        f"≥ {SIM_RATIO_ONE}× on at least one workload":
            None if all(c["ratio_9"] is None for c in cs.values()) else any(
                c["ratio_9"] is not None and c["ratio_9"] >= SIM_RATIO_ONE for c in cs.values()),
        f"slice captures ≥ {SIM_CAPTURED_MIN:.0%} of pooled-bound's gain on every workload":
            _all([True if c["above_bound_9"] else c["captured_9"] for c in cs.values()],
                 lambda v: v is True or v >= SIM_CAPTURED_MIN),
        "slice ahead of container-realloc, muxserve and token-pool on every workload":
            _all([c["ahead_9"] for c in cs.values()], bool),
        f"planned container sustains ≥ {PLANNED_OVER_AVGWORK:g}× container-avgwork's scale on Azure α = 1.3":
            _all([c["planned_over_avgwork"] for w, c in cs.items()
                  if PLANNED_CHECKED_ON in w and c["planned_over_avgwork"] is not None] or [None],
                 lambda v: v >= PLANNED_OVER_AVGWORK),
    }


def _order(pol: Mapping[str, Any], names: list[str], key: str) -> list[str]:
    return sorted(names, key=lambda n: -pol[n][f"tokens_per_s_{key}"])


def run_ratios(first: Mapping[str, Any], repeats: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """slice ÷ container at ≤ 9 % and ≤ 1 % of one mesh search and of its repeats (the same part run again by the
    same ``bench results`` invocation): each run's pair and, with repeats, their medians (None unless every run has
    the figure)."""
    def pair(res: Mapping[str, Any]) -> tuple[Any, Any]:
        rc = res.get("ratio_to_container") or ratios(res["policies"])
        return _get(rc, "slice", "9"), _get(rc, "slice", "1")

    runs = [pair(r) for r in (first, *repeats)]
    out: dict[str, Any] = {"ratio_9": runs[0][0], "ratio_1": runs[0][1], "runs": runs,
                           "median_9": None, "median_1": None}
    if len(runs) > 1:
        for i, key in ((0, "median_9"), (1, "median_1")):
            vals = [x[i] for x in runs]
            out[key] = None if None in vals else statistics.median(vals)
    return out


def read_ratio(c: Mapping[str, Any], key: str) -> Any:
    """The figure a mesh target reads: the median over the runs when the part ran more than once, else the run's."""
    return c[f"median_{key}"] if len(c["runs"]) > 1 else c[f"ratio_{key}"]


def emulated_checks(em: Mapping[str, Any], pred: Mapping[str, Any],
                    repeats: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Measured (emulated mesh) vs predicted (simulator) slice ÷ container and policy ordering, at both bounds;
    with ``repeats`` the measured figure is the median over the runs, and the ordering is read from it."""
    runs = run_ratios(em, repeats)
    out: dict[str, Any] = {"runs": runs["runs"]}
    common = [n for n in em["policies"] if n in pred["policies"] and n not in ("pooled-bound", "pooled")]
    for key in ("9", "1"):
        m = read_ratio(runs, key)
        p = _get(pred.get("ratio_to_container") or ratios(pred["policies"]), "slice", key)
        out[f"measured_{key}"], out[f"predicted_{key}"] = m, p
        out[f"difference_{key}"] = (m - p) / p if m is not None and p else None
        if repeats:  # the two mesh policies: slice ahead of container or not, on the median
            out[f"same_order_{key}"] = None if m is None or p is None else (m > 1) == (p > 1)
        else:
            out[f"same_order_{key}"] = (_order(em["policies"], common, key) == _order(pred["policies"], common, key)
                                        if len(common) >= 2 else None)
    d = out["difference_9"]
    out["within_15"] = None if d is None else abs(d) <= EMULATED_MAX_DIFF
    return out


def real_checks(real: Mapping[str, Any], repeats: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """slice ÷ container in measured tokens/s on the real CPU mesh and the ≥ 1.3× target; with ``repeats`` also each
    run's ratios and their medians (``run_ratios``), and the target is read on the median ≤ 9 % ratio."""
    out = run_ratios(real, repeats)
    target = read_ratio(out, "9")
    out["meets"] = None if target is None else target >= REAL_RATIO_MIN
    return out
