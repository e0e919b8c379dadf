"""Capacity planning of static containers under the per-request, per-tenant SLA, by simulation.

Under static containers (the ``container`` policy) tenants share nothing: a tenant's violations depend only on its
own arrivals and its own devices. So the largest load a partition sustains is found tenant by tenant: at a rate
scale s, tenant t needs ``n_t(s)``, the fewest devices on which its violation rate stays within the bound on every
tuning seed, and s is sustainable iff ``Σ n_t(s) ≤ N``. :class:`ContainerPlanner` bisects s (in log space) for the
largest sustainable scale, then gives the devices left over one at a time to the tenant that violates most just
above it. On the tuning seeds this maximises the sustained scale (for violation rates that fall as devices are
added); that is the partition an operator sizing containers by simulation would choose.

Pure and deterministic: the workloads come from ``workload_at(seed, scale)``; the simulator runs in process.
Devices of one kind and memory size are interchangeable; mixed clusters are refused.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Callable

from shared.config import ClusterConfig
from shared.policies.container import ContainerPolicy
from shared.sim.simulator import SimConfig, Simulator
from shared.workload import Workload


class PlanError(ValueError):
    """The cluster or workload cannot be planned (a message for the user)."""


@dataclass
class TenantNeed:
    """What planning found for one tenant: its devices, and its load and violations at the planned scale."""

    devices: int
    requests: int = 0
    violation_rate: float = 0.0


@dataclass
class Plan:
    """The planned partition: devices per tenant and the scale it sustains on the tuning seeds."""

    counts: dict[str, int]
    max_scale: float
    seeds: tuple[int, ...]
    bound: float
    needs: dict[str, TenantNeed] = field(default_factory=dict)
    simulations: int = 0


class ContainerPlanner:
    """Plans how many devices of ``cluster`` each tenant's container gets (see the module docstring)."""

    def __init__(self, cluster: ClusterConfig, workload_at: Callable[[int, float], Workload],
                 seeds: tuple[int, ...], bound: float = 0.09, tolerance: float = 0.03,
                 sim_config: SimConfig | None = None) -> None:
        kinds = {(d.kind, d.memory_bytes) for d in cluster.devices}
        if len(kinds) != 1:
            raise PlanError(f"{cluster.source}: planning needs devices of one kind and memory size, found "
                            f"{', '.join(sorted(f'{k} {m / 2**30:.0f} GiB' for k, m in kinds))}")
        if not seeds:
            raise PlanError("planning needs at least one tuning seed")
        self.cluster, self.workload_at, self.seeds = cluster, workload_at, tuple(seeds)
        self.bound, self.tolerance = bound, tolerance
        self.cfg = sim_config or SimConfig()
        self.n = len(cluster.devices)
        self._workloads: dict[tuple[int, float], dict[str, Workload]] = {}
        self._cache: dict[tuple[str, int, float, int], tuple[int, float]] = {}
        self.simulations = 0

    # ---------------------------------------------------------------- one tenant on n devices
    def _split(self, seed: int, scale: float) -> dict[str, Workload]:
        key = (seed, scale)
        if key not in self._workloads:
            w = self.workload_at(seed, scale)
            by: dict[str, list] = {t.name: [] for t in w.tenants.tenants}
            for r in w.requests:
                by[r.tenant].append(r)
            self._workloads[key] = {
                t.name: dataclasses.replace(w, requests=tuple(by[t.name]), tenants=dataclasses.replace(
                    w.tenants, tenants=(dataclasses.replace(t, home_devices=()),)))
                for t in w.tenants.tenants}
            if len(self._workloads) > 4 * len(self.seeds):  # keep the recent scales only
                self._workloads.pop(next(iter(self._workloads)))
        return self._workloads[key]

    def tenant_result(self, tenant: str, n: int, scale: float, seed: int) -> tuple[int, float]:
        """(requests, violation rate) of ``tenant`` alone on ``n`` devices at ``scale`` with arrival ``seed``."""
        key = (tenant, n, scale, seed)
        if key not in self._cache:
            w = self._split(seed, scale)[tenant]
            if not w.requests:
                self._cache[key] = (0, 0.0)
                return self._cache[key]
            devs = self.cluster.devices[:n]
            cluster = dataclasses.replace(self.cluster, devices=devs)
            t = w.tenants.tenants[0]
            tenants = dataclasses.replace(w.tenants, tenants=(dataclasses.replace(
                t, home_devices=tuple(d.id for d in devs)),))
            w = dataclasses.replace(w, tenants=tenants)
            sim = Simulator(cluster, tenants, ContainerPolicy(), self.cfg, random.Random(seed))
            sim.stop_above(w, self.bound, 0)
            r = sim.run(w).tenants[tenant]
            self.simulations += 1
            self._cache[key] = (r["requests"], r["violation_rate"])
        return self._cache[key]

    def worst(self, tenant: str, n: int, scale: float) -> tuple[int, float]:
        """(fewest requests, highest violation rate) over the tuning seeds (a run that stopped early, on passing
        the bound, reports the violations up to its stop)."""
        rs = [self.tenant_result(tenant, n, scale, s) for s in self.seeds]
        return min(r[0] for r in rs), max(r[1] for r in rs)

    def passes(self, tenant: str, n: int, scale: float) -> bool:
        """Within the bound on every tuning seed (the seeds after the first failure are not simulated)."""
        return all(self.tenant_result(tenant, n, scale, s)[1] <= self.bound for s in self.seeds)

    def min_devices(self, tenant: str, scale: float, start: int = 1, limit: int | None = None) -> int | None:
        """Fewest devices (≥ ``start``) on which ``tenant`` passes at ``scale``; None above ``limit``."""
        limit = self.n if limit is None else min(limit, self.n)
        n = max(1, start)
        while n <= limit:
            if self.passes(tenant, n, scale):
                return n
            n += 1
        return None

    # ---------------------------------------------------------------- the partition
    def counts_at(self, scale: float, floor: dict[str, int] | None = None) -> dict[str, int] | None:
        """Fewest devices per tenant at ``scale`` (each at least ``floor[t]``), or None when they exceed N."""
        names = self.tenants()
        floor = floor or {}
        left = self.n - sum(max(1, floor.get(t, 1)) for t in names)
        out: dict[str, int] = {}
        for t in names:
            start = max(1, floor.get(t, 1))
            n = self.min_devices(t, scale, start, start + left)
            if n is None:
                return None
            left -= n - start
            out[t] = n
        return out

    def tenants(self) -> list[str]:
        return list(self._split(self.seeds[0], 1.0))

    def plan(self, start_scale: float = 1.0, max_scale: float = 1024.0) -> Plan:
        """The partition that sustains the largest scale on the tuning seeds (see the module docstring)."""
        names = self.tenants()
        if len(names) > self.n:
            raise PlanError(f"{len(names)} tenants need at least {len(names)} devices; the cluster has {self.n}")
        lo, hi, lo_counts = None, None, None
        s = start_scale
        while lo is None or hi is None:
            c = self.counts_at(s, lo_counts)
            if c is not None:
                lo, lo_counts = s, c
                if hi is None:
                    if s >= max_scale:
                        break
                    s = min(s * 2, max_scale)
            else:
                hi = s
                if lo is None:
                    s /= 2
                    if s < 1e-4:
                        raise PlanError("no scale is sustainable: a tenant violates the SLA even with every "
                                        "device of the cluster at almost no load")
        while hi is not None and hi / lo > 1 + self.tolerance:
            mid = math.sqrt(lo * hi)
            c = self.counts_at(mid, lo_counts)
            if c is not None:
                lo, lo_counts = mid, c
            else:
                hi = mid
        assert lo is not None and lo_counts is not None
        counts = dict(lo_counts)
        probe = hi if hi is not None else lo
        for _ in range(self.n - sum(counts.values())):  # leftovers: to whoever violates most just above lo
            t = max(names, key=lambda t: (self.worst(t, counts[t], probe)[1], -names.index(t)))
            counts[t] += 1
        needs = {}
        for t in names:
            req, rate = self.worst(t, counts[t], lo)
            needs[t] = TenantNeed(counts[t], req, rate)
        return Plan(counts=counts, max_scale=lo, seeds=self.seeds, bound=self.bound, needs=needs,
                    simulations=self.simulations)

    def devices_for(self, scale: float) -> dict[str, TenantNeed]:
        """Fewest devices per tenant to carry ``scale`` within the bound (no cluster-size limit)."""
        out = {}
        for t in self.tenants():
            n = self.min_devices(t, scale)
            if n is None:
                raise PlanError(f"{t} violates the SLA at scale {scale:g} even on all {self.n} devices")
            req, rate = self.worst(t, n, scale)
            out[t] = TenantNeed(n, req, rate)
        return out


__all__ = ["ContainerPlanner", "Plan", "PlanError", "TenantNeed"]
