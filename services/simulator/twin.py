"""The simulator's twin of the live cluster: the GMG (from the follower) plus what the simulator learns from the
request and event streams (request lengths, arrival rates, measured segment times), turned into per-device work
for forecasts and what-if, and into the policies' :class:`~shared.policies.snapshot.ClusterSnapshot`."""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel import CorrectionTable, ModelCost, cost_for, load_profile
from shared.gmg.snapshot import GMGSnapshot
from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, TenantState
from services.simulator.forecast import DeviceWork, Seq

REQUESTS_MAX = 100_000
UP_STATES = ("ready", "starting")


@dataclass
class ReqInfo:
    tenant: str
    input_tokens: int
    max_tokens: int
    arrival_ts: float


class RequestBook:
    """Lengths of recent requests by id (from the requests stream), bounded."""

    def __init__(self, max_items: int = REQUESTS_MAX) -> None:
        self.items: OrderedDict[str, ReqInfo] = OrderedDict()
        self.max_items = max_items

    def add(self, request_id: str, info: ReqInfo) -> None:
        self.items[request_id] = info
        self.items.move_to_end(request_id)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)

    def get(self, request_id: str) -> ReqInfo | None:
        return self.items.get(request_id)


class RateEstimator:
    """Per-tenant arrival rate over a sliding window, and EWMA request lengths."""

    def __init__(self, window_s: float = 10.0, alpha: float = 0.05) -> None:
        self.window_s, self.alpha = window_s, alpha
        self.arrivals: dict[str, deque[float]] = {}
        self.first_ts: dict[str, float] = {}
        self.mean_input: dict[str, float] = {}
        self.mean_output: dict[str, float] = {}

    def observe_arrival(self, tenant: str, ts: float, input_tokens: int, max_tokens: int) -> None:
        self.arrivals.setdefault(tenant, deque()).append(ts)
        self.first_ts.setdefault(tenant, ts)
        self._ewma(self.mean_input, tenant, input_tokens)
        if tenant not in self.mean_output:
            self.mean_output[tenant] = float(max_tokens)  # until finished requests tell the real length

    def observe_output(self, tenant: str, completion_tokens: int) -> None:
        if completion_tokens > 0:
            self._ewma(self.mean_output, tenant, completion_tokens)

    def _ewma(self, table: dict[str, float], tenant: str, v: float) -> None:
        old = table.get(tenant)
        table[tenant] = float(v) if old is None else (1 - self.alpha) * old + self.alpha * v

    def rate(self, tenant: str, now: float) -> float:
        """Arrivals per second over the window (over the time seen so far while the window is not yet full)."""
        q = self.arrivals.get(tenant)
        if not q:
            return 0.0
        while q and q[0] < now - self.window_s:
            q.popleft()
        span = min(self.window_s, max(1.0, now - self.first_ts[tenant]))
        return len(q) / span

    def rates(self, now: float) -> dict[str, float]:
        return {t: self.rate(t, now) for t in self.arrivals}


class Twin:
    """Builds per-device work and the policies' snapshot from the newest GMG snapshot."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, *, book: RequestBook | None = None,
                 rates: RateEstimator | None = None, corrections: CorrectionTable | None = None,
                 default_input: int = 512, default_output: int = 128) -> None:
        self.cluster, self.tenants = cluster, tenants
        self._names = frozenset(tenants.names())
        self.book = book or RequestBook()
        self.rates = rates or RateEstimator()
        self.corrections = corrections or CorrectionTable()
        self.default_input, self.default_output = default_input, default_output
        self.profiles = {d.id: load_profile(d.kind) for d in cluster.devices}
        self.kinds = {d.id: d.kind for d in cluster.devices}
        self._costs: dict[tuple[str, str], tuple[tuple, ModelCost]] = {}

    def configured(self, tenant: str | None) -> str | None:
        """``tenant`` if the tenants file has it, else None: a GMG read before its start-up reconciliation (or
        mid-way through one) may still name a tenant the new configuration removed."""
        return tenant if tenant and tenant in self._names else None

    def cost(self, tenant: str, device: str) -> ModelCost | None:
        """``tenant``'s model on ``device``'s profile, with the device's current correction factors."""
        try:
            cfg = self.tenants.get(tenant).model.config
        except KeyError:
            return None
        prof = self.profiles.get(device)
        if prof is None:
            return None
        corr = tuple(sorted((k, round(v, 2)) for k, v in self.corrections.factors_for(device).items()))
        if not corr:
            return cost_for(cfg, self.kinds[device])  # shared, uncorrected
        hit = self._costs.get((tenant, device))
        if hit is None or hit[0] != corr:  # rebuilt only when a factor moved by 0.01 or more
            hit = self._costs[(tenant, device)] = (corr, ModelCost(cfg, prof, dict(corr)))
        return hit[1]

    def means(self, tenant: str) -> tuple[float, float]:
        return (self.rates.mean_input.get(tenant, float(self.default_input)),
                self.rates.mean_output.get(tenant, float(self.default_output)))

    def device_work(self, snap: GMGSnapshot, now: float) -> dict[str, DeviceWork]:
        """Per-device work now: running sequences (progress estimated from elapsed time), queue, arrival rate."""
        rates = self.rates.rates(now)
        return {did: self.work_of(snap, did, now, rates) for did in snap.devices}

    def work_of(self, snap: GMGSnapshot, did: str, now: float, rates: dict[str, float]) -> DeviceWork:
        """One device's work (see :meth:`device_work`)."""
        dev = snap.devices[did]
        tenant = self.configured(dev.home_tenant) or ""
        cost = self.cost(tenant, did) if tenant else None
        mi, mo = self.means(tenant) if tenant else (0.0, 0.0)
        kvpt = self.tenants.get(tenant).model.config.kv_bytes_per_token() if tenant else 0
        reqs = snap.requests.get(did, {})
        seqs = []
        for rid in reqs:
            info = self.book.get(rid)
            inp, mx = (info.input_tokens, info.max_tokens) if info else (int(mi), int(mo))
            seqs.append(Seq(rid, inp, min(mx, max(1, int(mo))), (inp + mx) * kvpt))
        if cost is not None and seqs:
            it = cost.iteration_time(len(seqs), sum(s.ctx for s in seqs))
            for s, r in zip(seqs, reqs.values()):
                done = min(int(max(0.0, now - r.started_ts) / max(it, 1e-6)), s.remaining - 1)
                s.ctx += done
                s.remaining -= done
        homes = max(1, len(self.tenants.get(tenant).home_devices)) if tenant else 1
        return DeviceWork(did, tenant, cost, dev.limit, dev.reserved, seqs, queued=max(0, dev.queued),
                          rate_rps=rates.get(tenant, 0.0) / homes, mean_input=mi or self.default_input,
                          mean_output=mo or self.default_output, kv_bytes_per_token=kvpt,
                          up=dev.state in UP_STATES)

    def cluster_snapshot(self, snap: GMGSnapshot, works: dict[str, DeviceWork], now: float) -> ClusterSnapshot:
        """The policies' snapshot of the live cluster (the same type the offline simulator keeps)."""
        shares: dict[str, float] = {}
        for x in snap.leases.values():
            shares[x.guest] = shares.get(x.guest, 0.0) + x.share
        devices = {}
        for did, d in snap.devices.items():
            w = works.get(did)
            seqs = w.seqs if w else []
            pinned = {k for k, n in snap.pins.get(did, {}).items() if n > 0}
            staged = {k: n for k, n in snap.resident.get(did, {}).items() if k[0] != d.home_tenant}
            queued = w.queued if w else d.queued
            home = self.configured(d.home_tenant)
            devices[did] = DeviceState(
                id=did, kind=d.kind, host=d.host, capacity_bytes=d.capacity, headroom_bytes=d.headroom,
                home_tenant=home, tenants=[home] if home else [],
                used_bytes=d.reserved, kv_bytes=snap.reserved_by_kind(did).get("kv", 0),
                staged_bytes=sum(staged.values()), evictable_bytes=sum(n for k, n in staged.items() if k not in pinned),
                queued=queued, running=len(seqs), queued_prefill_tokens=int(queued * (w.mean_input if w else 0)),
                decode_kv_tokens=sum(s.ctx for s in seqs), busy=bool(seqs or queued),
                guest_share=shares.get(did, 0.0), resident=staged, draining=d.state in ("draining", "down"))
        leases = {lid: LeaseState(lid, x.tenant, x.home, x.guest, x.segments, x.start_ts, x.end_ts, x.nbytes,
                                  x.share, mode=x.mode, state="active", handback=x.handback) for lid, x in snap.leases.items()}
        tenants = {}
        for t in self.tenants.tenants:
            mi, mo = self.means(t.name)
            homes = [devices[h] for h in t.home_devices if h in devices]
            tenants[t.name] = TenantState(t.name, t.model.config, t.sla, list(t.home_devices),
                                          queued=sum(h.queued for h in homes), running=sum(h.running for h in homes),
                                          rate_rps=self.rates.rate(t.name, now), mean_input=mi, mean_output=mo,
                                          slack_s=math.inf)
        return ClusterSnapshot(now=now, devices=devices, tenants=tenants, leases=leases,
                               intra_host_link=self.cluster.intra_host_link,
                               inter_host_link=self.cluster.inter_host_link, epoch=snap.epoch)
