"""Run metrics per DESIGN §9: throughput, TTFT/TPOT percentiles, SLA violations, utilisation, memory over time."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.costmodel.sla import RequestTargets
from shared.sim.request import DONE

MIN_TENANT_REQUESTS = 100  # tenants with fewer requests at a point count only in the aggregate (DESIGN §9)

if TYPE_CHECKING:
    from shared.sim.simulator import Simulator
    from shared.workload import Workload


@dataclass
class SimResult:
    """Everything one run measured; :meth:`to_dict` gives the JSON layout of ``slicesched simulate``."""

    policy: dict[str, Any]
    workload: str
    seed: int
    rate_scale: float
    window_s: float
    end_s: float
    events: int
    tokens_per_s: float
    violation_rate: float
    total: dict[str, Any]
    tenants: dict[str, dict[str, Any]]
    devices: dict[str, dict[str, Any]]
    memory_timeline: dict[str, list[list[float]]]
    leases: dict[str, Any]
    links: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "violation_rate": self.violation_rate, "events": self.events,
                "policy": self.policy, "workload": self.workload, "seed": self.seed, "rate_scale": self.rate_scale,
                "window_s": self.window_s, "end_s": self.end_s, "fidelity": "sim", "total": self.total,
                "tenants": self.tenants, "devices": self.devices, "memory_timeline": self.memory_timeline,
                "leases": self.leases, "links": self.links, **self.extra}


def _pct(values: np.ndarray, scale: float = 1000.0) -> dict[str, float | None]:
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p = np.percentile(values, [50, 90, 99]) * scale
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "mean": float(values.mean() * scale)}


def _group(rows: list, window: float, ttft_sla: np.ndarray | None = None) -> dict[str, Any]:
    n = len(rows)
    done = [r for r in rows if r.status == DONE]
    ttft = np.array([r.first_token - r.arrival for r in done])
    tpot = np.array([(r.finish - r.first_token) / (r.output - 1) for r in done if r.output > 1])
    in_window = sum(r.output for r in done if r.finish <= window)
    return {"requests": n, "completed": len(done), "rejected_or_failed": n - len(done),
            "output_tokens": int(sum(r.output for r in done)), "tokens_per_s": in_window / window,
            "ttft_ms": _pct(ttft), "tpot_ms": _pct(tpot)}


def violation_cause(r, targets: RequestTargets) -> str | None:
    """Why request ``r`` violates its SLA — ``not_served``, ``ttft`` (first token past its target) or ``tpot`` —
    or None; ``targets(input, output)`` gives its (TTFT, TPOT) targets in seconds."""
    if r.status != DONE:
        return "not_served"
    ttft_s, tpot_s = targets(r.input, r.output)
    if r.first_token - r.arrival > ttft_s:
        return "ttft"
    if r.output > 1 and (r.finish - r.first_token) / (r.output - 1) > tpot_s:
        return "tpot"
    return None


def _violations(rows: list, targets: RequestTargets) -> tuple[int, dict[str, int]]:
    """Violating requests, and why (:func:`violation_cause`; a request counts once)."""
    v, why = 0, {"not_served": 0, "ttft": 0, "tpot": 0}
    for r in rows:
        c = violation_cause(r, targets)
        if c is not None:
            why[c] += 1
            v += 1
    return v, why


def worst_tenant(tenants: dict[str, dict[str, Any]], min_requests: int = MIN_TENANT_REQUESTS) -> tuple[str | None, float]:
    """(name, violation rate) of the worst tenant among those with at least ``min_requests`` requests (DESIGN §9:
    a point is sustainable only if each of them is within the bound too); (None, 0.0) when none has that many."""
    counted = [(v["violation_rate"], name) for name, v in tenants.items() if v["requests"] >= min_requests]
    if not counted:
        return None, 0.0
    rate, name = max(counted)
    return name, rate


def downsample_peak(timeline: list[tuple[float, int]], end: float, points: int) -> list[list[float]]:
    """At most ``points`` [time, bytes] pairs that keep every bucket's maximum (so peaks survive)."""
    if len(timeline) <= points:
        return [[t, float(b)] for t, b in timeline]
    width = max(end, timeline[-1][0]) / points or 1.0
    out: list[list[float]] = []
    cur_bucket, cur_max, cur_t = -1, -1, 0.0
    for t, b in timeline:
        k = int(t / width)
        if k != cur_bucket:
            if cur_bucket >= 0:
                out.append([cur_t, float(cur_max)])
            cur_bucket, cur_max, cur_t = k, b, t
        elif b > cur_max:
            cur_max, cur_t = b, t
    out.append([cur_t, float(cur_max)])
    return out


def collect(sim: "Simulator", workload: "Workload", window: float) -> SimResult:
    """Build the result of a finished run."""
    by_tenant: dict[str, list] = {}
    for r in sim.requests:
        by_tenant.setdefault(r.tenant, []).append(r)
    tenants, viol_total, why_total = {}, 0, {}
    for name, rows in sorted(by_tenant.items()):
        ts = sim.snapshot.tenants[name]
        sla = ts.sla
        g = _group(rows, window)
        v, why = _violations(rows, RequestTargets(sla, ts.model, sim.cfg.max_batched_tokens))
        viol_total += v
        for k, n in why.items():
            why_total[k] = why_total.get(k, 0) + n
        g.update(violations=v, violation_rate=v / len(rows) if rows else 0.0, violations_by_cause=why,
                 sla={"ttft_ms": sla.ttft_ms, "tpot_ms": sla.tpot_ms, "slowdown": sla.slowdown})
        tenants[name] = g
    total = _group(sim.requests, window)
    n = len(sim.requests)
    total.update(violations=viol_total, violation_rate=viol_total / n if n else 0.0, violations_by_cause=why_total)
    total["worst_tenant"], total["worst_tenant_violation_rate"] = worst_tenant(tenants)
    end = sim.now
    devices, timeline = {}, {}
    span = max(end, window)
    for d in sim.devices.values():
        m = d.mem
        devices[d.id] = {"kind": d.kind, "host": d.host, "utilization": d.busy_s / span,
                         "guest_utilization": d.guest_busy_s / span, "busy_s": d.busy_s, "work_s": d.work_s,
                         "memory_limit_bytes": m.limit, "memory_peak_bytes": m.peak,
                         "memory_peak_fraction": m.peak / m.capacity,
                         "tenants": sorted({e.tenant for e in d.engines}), "switches": d.switches}
        timeline[d.id] = downsample_peak(m.timeline, end, sim.cfg.timeline_points)
    book = sim.leases
    finished = book.finished + list(book.leases.values())
    leases = {k: v for k, v in book.stats.items()}
    leases["guest_busy_s"] = sum(lease.guest_busy_s for lease in finished)  # offloaded segments
    leases["lane_busy_s"] = sum(lease.lane_busy_s for lease in finished)  # "sequences" lanes
    by_tenant: dict[str, dict[str, float]] = {}
    for lease in finished:
        row = by_tenant.setdefault(lease.tenant, {"granted": 0, "guest_busy_s": 0.0, "lane_busy_s": 0.0})
        row["granted"] += 1
        row["guest_busy_s"] += lease.guest_busy_s
        row["lane_busy_s"] += lease.lane_busy_s
    leases["by_tenant"] = dict(sorted(by_tenant.items()))
    leases["activation_bytes_moved"] = sum(lease.link_bytes for lease in finished)
    leases["offloaded_iterations"] = sum(e.offload_iters for d in sim.devices.values() for e in d.engines)
    links = {"staging_busy_s": book.link_busy_s, "staging_bytes": book.link_bytes}
    util = [v["utilization"] for v in devices.values()]
    total["device_utilization_mean"] = sum(util) / len(util) if util else 0.0  # own work only
    # the time devices worked, own and guest (lane iterations, offloaded segments; an own step stretched by what it
    # yielded counts its own part only): how much of the cluster's time was spent, and per 1,000 output tokens
    work = sum(d.work_s for d in sim.devices.values())
    total["device_busy_mean"] = work / (span * len(devices)) if devices else 0.0
    tokens = total.get("output_tokens", 0)
    total["device_s_per_1k_tokens"] = work / tokens * 1e3 if tokens else None
    total["memory_peak_fraction_max"] = max((v["memory_peak_fraction"] for v in devices.values()), default=0.0)
    return SimResult(policy=sim.policy.describe(), workload=workload.name, seed=workload.seed,
                     rate_scale=workload.rate_scale, window_s=window, end_s=end, events=sim.events,
                     tokens_per_s=total["tokens_per_s"], violation_rate=total["violation_rate"], total=total,
                     tenants=tenants, devices=devices, memory_timeline=timeline, leases=leases, links=links)
