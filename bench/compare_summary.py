"""The summary side of ``bench compare``: ratios to ``container``, the share of ``pooled-bound``'s gain, and
medians with ranges over the arrival seeds."""
from __future__ import annotations

from typing import Any

BOUNDS = {"9": 0.09, "1": 0.01}


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def median_policies(per_seed: dict[str, dict[str, Any]], policies: list[str]) -> dict[str, dict[str, Any]]:
    """Per policy: the median over seeds of each boundary figure, its range, and the worst tenant over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for p in policies:
        rows = [ps["policies"][p] for ps in per_seed.values()]
        m: dict[str, Any] = {}
        for key in BOUNDS:
            for f in ("max_scale", "tokens_per_s", "violation_rate"):
                vals = [r[f"{f}_{key}"] for r in rows]
                m[f"{f}_{key}"] = _median(vals)
                good = [v for v in vals if v is not None]
                m[f"{f}_{key}_range"] = [min(good), max(good)] if good else None
            worst = max(rows, key=lambda r: r[f"worst_tenant_violation_rate_{key}"] or 0.0)
            m[f"worst_tenant_{key}"] = worst[f"worst_tenant_{key}"]
            m[f"worst_tenant_violation_rate_{key}"] = worst[f"worst_tenant_violation_rate_{key}"]
        m["violation_rate"] = m["violation_rate_9"]
        m["leases"] = rows[len(rows) // 2].get("leases")
        out[p] = m
    return out


def median_of(per_seed: dict[str, dict[str, Any]], field: str) -> dict[str, dict[str, Any]]:
    """Median (and range) over seeds of a per-seed ratio table (policy -> bound -> value)."""
    tables = [ps[field] for ps in per_seed.values()]
    if not tables or not tables[0]:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name in tables[0]:
        out[name] = {}
        for key in BOUNDS:
            vals = [t[name][key] for t in tables if t.get(name, {}).get(key) is not None]
            out[name][key] = _median(vals)
            out[name][f"{key}_range"] = [min(vals), max(vals)] if vals else None
    return out


def ratios(pol: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """tokens/s of each policy over container's, at each bound."""
    if "container" not in pol:
        return {}
    out = {}
    for name, r in pol.items():
        out[name] = {}
        for key in BOUNDS:
            base = pol["container"][f"tokens_per_s_{key}"]
            out[name][key] = r[f"tokens_per_s_{key}"] / base if base else None
    return out


def captured(pol: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """(policy − container) / (pooled-bound − container) per policy, at each bound."""
    if "container" not in pol or "pooled-bound" not in pol:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for name, r in pol.items():
        if name in ("container", "pooled-bound"):
            continue
        out[name] = {}
        for key in BOUNDS:
            c, p = pol["container"][f"tokens_per_s_{key}"], pol["pooled-bound"][f"tokens_per_s_{key}"]
            out[name][key] = (r[f"tokens_per_s_{key}"] - c) / (p - c) if p - c > 0 else None
    return out
