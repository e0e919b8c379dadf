"""Where a run's SLA violations are, and what idle capacity existed while they happened (``bench anatomy``).

A simulator run records every device's busy time in fixed bins (:class:`BusyBins`: own iterations, and guest work
— lane iterations and offloaded segments — apart). :func:`anatomy` then answers, per run and per tenant: which
requests violated and why (TTFT, TPOT, not served); how late the TTFT violations were; how busy the tenant's own
container was while they waited; and how much device time stood idle *outside* the tenant's container over the
same waits (in device-equivalents: 1.0 = one whole device idle throughout the wait). That last figure is what a
placement policy could at most have reached for those requests, ignoring memory and staging time.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.costmodel.sla import RequestTargets
from shared.sim.metrics import violation_cause

if TYPE_CHECKING:
    from shared.sim.simulator import Simulator
    from shared.workload import Workload

DEFAULT_BIN_S = 0.25


class BusyBins:
    """Busy seconds of one device per ``bin_s`` bin, own work and guest work apart."""

    __slots__ = ("bin_s", "own", "guest")

    def __init__(self, bin_s: float = DEFAULT_BIN_S) -> None:
        if not bin_s > 0:
            raise ValueError(f"bin_s must be > 0, not {bin_s!r}")
        self.bin_s = bin_s
        self.own: list[float] = []
        self.guest: list[float] = []

    def add(self, start: float, end: float, guest: bool = False, weight: float = 1.0) -> None:
        """``weight`` × the time in [start, end) was busy (spread over the bins it covers)."""
        if end <= start or weight <= 0:
            return
        b = self.bin_s
        arr = self.guest if guest else self.own
        i, last = int(start / b), int(end / b)
        if last >= len(arr):
            n = last + 1 - len(arr)
            self.own.extend([0.0] * n)
            self.guest.extend([0.0] * n)
        if i == last:
            arr[i] += (end - start) * weight
            return
        arr[i] += ((i + 1) * b - start) * weight
        for k in range(i + 1, last):
            arr[k] += b * weight
        arr[last] += (end - last * b) * weight

    def idle(self, n: int) -> np.ndarray:
        """Idle fraction of each of the first ``n`` bins (0 … 1)."""
        busy = np.zeros(n)
        m = min(n, len(self.own))
        busy[:m] = np.asarray(self.own[:m]) + np.asarray(self.guest[:m])
        return np.clip(1.0 - busy / self.bin_s, 0.0, 1.0)


def _pcts(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "mean": None}
    a = np.asarray(values) * scale
    p50, p90 = np.percentile(a, [50, 90])
    return {"p50": float(p50), "p90": float(p90), "mean": float(a.mean())}


def anatomy(sim: "Simulator", workload: "Workload", bin_s: float) -> dict[str, Any]:
    """Violations of a finished run by cause and tenant, with the idle capacity elsewhere during TTFT waits."""
    n_bins = max(1, int(math.ceil(max(sim.now, 1e-9) / bin_s)))
    devs = list(sim.devices.values())
    col = {d.id: i for i, d in enumerate(devs)}
    idle = np.vstack([(d.bins.idle(n_bins) if d.bins is not None else np.zeros(n_bins)) for d in devs])
    total_idle = idle.sum(axis=0)
    containers = {t.name: [col[x] for x in t.home_devices if x in col] for t in workload.tenants.tenants}
    # per tenant: cumulative idle device-equivalents outside / inside its container, for window means
    cum_out, cum_in = {}, {}
    for name, idx in containers.items():
        inside = idle[idx].sum(axis=0) if idx else np.zeros(n_bins)
        cum_out[name] = np.concatenate([[0.0], np.cumsum(total_idle - inside)])
        cum_in[name] = np.concatenate([[0.0], np.cumsum(inside)])

    def window_mean(cum: np.ndarray, a: float, b: float) -> float:
        i, j = int(a / bin_s), min(n_bins, int(b / bin_s) + 1)
        return float((cum[j] - cum[i]) / max(1, j - i))

    tenants: dict[str, dict[str, Any]] = {}
    excess, waits, idle_out, own_busy = [], [], [], []
    targets = {name: RequestTargets(ts.sla, ts.model, sim.cfg.max_batched_tokens)
               for name, ts in sim.snapshot.tenants.items()}
    by_tenant: dict[str, list] = {}
    for r in sim.requests:
        by_tenant.setdefault(r.tenant, []).append(r)
    for name, rows in sorted(by_tenant.items()):
        tgt = targets[name]
        k = max(1, len(containers.get(name, ())))
        t = {"requests": len(rows), "devices": len(containers.get(name, ())), "ttft": 0, "tpot": 0, "not_served": 0}
        t_idle: list[float] = []
        for r in rows:
            cause = violation_cause(r, tgt)
            if cause is None:
                continue
            t[cause] += 1
            if cause == "ttft":
                ttft = r.first_token - r.arrival
                excess.append(ttft - tgt(r.input, r.output)[0])
                waits.append(ttft)
                v = window_mean(cum_out[name], r.arrival, r.first_token)
                idle_out.append(v)
                t_idle.append(v)
                own_busy.append(1.0 - window_mean(cum_in[name], r.arrival, r.first_token) / k)
        t["violations"] = t["ttft"] + t["tpot"] + t["not_served"]
        t["idle_elsewhere_p50"] = _pcts(t_idle)["p50"]
        tenants[name] = t
    n = len(sim.requests)
    # device figures over the measured window (the arrivals'), as the run's throughput: not the drain after it
    reqs = workload.requests
    window = workload.duration_s or (reqs[-1].arrival_s if reqs else 0.0) or sim.now or 1.0
    w_bins = max(1, min(n_bins, int(round(window / bin_s))))
    span = w_bins * bin_s
    own = np.array([sum(d.bins.own[:w_bins]) / span if d.bins is not None else 0.0 for d in devs])
    guest = np.array([sum(d.bins.guest[:w_bins]) / span if d.bins is not None else 0.0 for d in devs])
    book = sim.leases
    finished = book.finished + list(book.leases.values())
    lifetimes = [max(0.0, min(x.end, sim.now) - x.start) for x in finished]
    v = sum(t["violations"] for t in tenants.values())
    return {
        "bin_s": bin_s, "window_s": span, "end_s": sim.now, "requests": n, "violations": v,
        "by_cause": {c: sum(t[c] for t in tenants.values()) for c in ("ttft", "tpot", "not_served")},
        "ttft_violations": {
            "excess_ms": _pcts(excess, 1e3), "wait_ms": _pcts(waits, 1e3),
            "idle_elsewhere": _pcts(idle_out),
            "with_idle_device_elsewhere": (sum(1 for x in idle_out if x >= 1.0) / len(idle_out)) if idle_out else None,
            "own_container_busy": _pcts(own_busy)},
        "devices": {"count": len(devs), "own_busy_mean": float(own.mean()) if len(own) else 0.0,
                    "guest_busy_mean": float(guest.mean()) if len(guest) else 0.0,
                    "idle_device_equivalents_mean": float(total_idle[:w_bins].mean()),
                    "memory_peak_fraction_max": max((d.mem.peak / d.mem.capacity for d in devs), default=0.0)},
        "leases": {"granted": book.stats.get("granted", 0), "revoked": book.stats.get("revoked", 0),
                   "sequences": sum(1 for x in finished if x.mode == "sequences"),
                   "segments": sum(1 for x in finished if x.mode == "segments"),
                   "lifetime_s": _pcts(lifetimes), "staging_busy_s": float(sum(book.link_busy_s.values())),
                   "guest_busy_s": float(sum(guest) * span)},
        "tenants": tenants,
    }
