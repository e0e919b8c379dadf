"""Fast analytical what-if over a cluster snapshot: what happens if these leases were granted now?

For each candidate :class:`~shared.policies.actions.GrantLease` it predicts, from the snapshot alone (no event
simulation): the leasing tenant's iteration time with and without the lease (pipelined micro-batches, transfers,
the guest's share), the TTFT/TPOT of its queued requests, the guest tenant's TTFT/TPOT once it loses the leased
share of its device (worst case: a typical request arrives while the lease holds), memory on the guest over the
window (staged weights + activation buffers + the KV its own tenant is predicted to need), a coarse busy timeline
for the two devices over the horizon, and which SLA or memory bound, if any, breaks. Pure Python, microseconds
per candidate; used inside the ``slice`` policy offline and by the simulator service live.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

from shared.config import ClusterConfig
from shared.costmodel import cost_for, load_profile
from shared.costmodel.model_cost import ModelCost
from shared.model.graph import parse_segment
from shared.policies.actions import GrantLease
from shared.policies.snapshot import ClusterSnapshot, DeviceState, TenantState
from shared.costmodel.offload import OffloadPart, micro_batch_parts, offloaded_iteration_time

LANE_BATCH = 16  # sequences a lane is assumed to decode at once when a lease is priced


@dataclass(frozen=True)
class WhatIfParams:
    """Batching constants the prediction assumes (the simulator's)."""

    max_batched_tokens: int = 2048
    micro_batches: int = 2
    kv_block_tokens: int = 16
    guest_margin: float = 0.8  # a guest tenant's predicted latency must stay under margin × its SLA
    slots: int = 8  # busy-timeline resolution over the horizon


@dataclass
class WhatIfResult:
    """Prediction for one candidate (times in seconds, memory in bytes)."""

    candidate: GrantLease
    home_iter_s: float
    leased_iter_s: float
    gain: float  # 1 - leased/home (fraction of the tenant's iteration time saved)
    ttft_s: float  # worst predicted TTFT of the leasing tenant's queued requests, with the lease
    tpot_s: float
    ttft_before_s: float
    guest_ttft_s: float  # a typical request of the guest's own tenant, arriving during the lease
    guest_tpot_s: float
    guest_memory_peak_bytes: int
    # (start, slot width, slots, ((device, busy fraction), ...)): the busy timeline, built when asked for (the
    # policies never read it; the simulator service's replies do)
    timeline: tuple | None = None
    breaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def busy_timeline(self) -> dict[str, list[tuple[float, float, float]]]:
        """Busy fraction per slot over the horizon for the two devices involved: device -> [(start, end, busy)]."""
        if self.timeline is None:
            return {}
        now, w, slots, fracs = self.timeline
        return {did: [(now + i * w, now + (i + 1) * w, f) for i in range(slots)] for did, f in fracs}


class WhatIf:
    """Predictions over a :class:`ClusterSnapshot`; build once per cluster, call :meth:`evaluate` per decision."""

    def __init__(self, links: dict[str, dict[str, object]] | None = None, params: WhatIfParams | None = None) -> None:
        self.params = params or WhatIfParams()
        self._costs: dict[tuple[str, str], tuple] = {}  # (tenant, device kind) -> (its model, its cost model)
        self._memo: dict | None = None  # per-evaluate cache of per-device terms (one snapshot)
        # (cost id, device) -> [running, queued prefill tokens, decode KV tokens, cost, iteration, micro-batch parts]:
        # a device's own iteration depends on those three numbers only, so it is recomputed only when they change
        self._iters: dict[tuple[int, str], list] = {}

    @classmethod
    def for_cluster(cls, cluster: ClusterConfig, snapshot: ClusterSnapshot | None = None, cfg=None) -> "WhatIf":
        """A what-if for ``cluster`` using the simulator config's batching constants when given."""
        p = WhatIfParams()
        if cfg is not None:
            p = WhatIfParams(max_batched_tokens=cfg.max_batched_tokens, micro_batches=cfg.micro_batches,
                             kv_block_tokens=cfg.kv_block_tokens)
        return cls(params=p)

    def cost(self, tenant: TenantState, kind: str) -> ModelCost:
        hit = self._costs.get((tenant.name, kind))
        if hit is None or hit[0] is not tenant.model:  # first use, or the tenant's model was replaced
            hit = self._costs[(tenant.name, kind)] = (tenant.model, cost_for(tenant.model, kind))
        return hit[1]

    def _cached(self, key: tuple, compute):
        """``compute()``, remembered for the rest of the current :meth:`evaluate` call (one snapshot)."""
        memo = self._memo
        if memo is None:
            return compute()
        v = memo.get(key)
        if v is None:
            v = memo[key] = compute()
        return v

    # ---------------------------------------------------------------- one device's own work
    def _iter_entry(self, cost: ModelCost, d: DeviceState) -> list:
        key = (id(cost), d.id)
        e = self._iters.get(key)
        r, q, kv = d.running, d.queued_prefill_tokens, d.decode_kv_tokens
        if e is None or e[0] != r or e[1] != q or e[2] != kv or e[3] is not cost:
            e = self._iters[key] = [r, q, kv, cost, self._device_iteration(cost, d), None]
        return e

    def device_iteration(self, cost: ModelCost, d: DeviceState) -> tuple[float, int, int, int]:
        """(iteration time, decode rows, prefill rows, sampled rows) of the device's next iteration, alone
        (remembered per device until its batch or queue changes)."""
        return self._iter_entry(cost, d)[4]

    def micro_batch_parts(self, cost: ModelCost, d: DeviceState) -> tuple[int, float, float, float]:
        """The home-side terms of an offloaded iteration of the device's next batch (see
        :func:`shared.costmodel.offload.micro_batch_parts`), remembered like :meth:`device_iteration`."""
        e = self._iter_entry(cost, d)
        if e[5] is None:
            _, b, p, sampled = e[4]
            e[5] = micro_batch_parts(cost, b, d.decode_kv_tokens, p, p * (p + 1) // 2, p, sampled,
                                     self.params.micro_batches)
        return e[5]

    def _device_iteration(self, cost: ModelCost, d: DeviceState) -> tuple[float, int, int, int]:
        b = max(0, d.running - (1 if d.queued_prefill_tokens else 0))
        it, p = cost.chunk_iteration(b, d.decode_kv_tokens, d.queued_prefill_tokens, self.params.max_batched_tokens)
        return it, b, p, b + (1 if p else 0)

    def tenant_latency(self, cost: ModelCost, d: DeviceState, tenant: TenantState, now: float,
                       iter_s: float, prefill_rows: int) -> tuple[float, float]:
        """(worst TTFT of queued requests, TPOT) if every iteration takes ``iter_s``."""
        if d.queued_prefill_tokens <= 0 or prefill_rows <= 0:
            waited = 0.0
            drain = 0.0
        else:
            waited = max(0.0, now - d.oldest_pending_s) if math.isfinite(d.oldest_pending_s) else 0.0
            drain = math.ceil(d.queued_prefill_tokens / prefill_rows) * iter_s
        return waited + drain, iter_s

    def guest_latency(self, cost: ModelCost, d: DeviceState, tenant: TenantState, share: float) -> tuple[float, float]:
        """(TTFT, TPOT) of a typical request of the device's own tenant arriving while ``share`` of the device is
        given away (its iterations stretch by 1/(1-share))."""
        stretch = 1.0 / max(1e-6, 1.0 - share)
        it, b, p, _ = self.device_iteration(cost, d)
        typical_in = int(tenant.mean_input) if tenant.mean_input > 0 else 1024
        prefill = cost.prefill_time(typical_in, self.params.max_batched_tokens)
        drain = (math.ceil(d.queued_prefill_tokens / max(1, p)) * it) if d.queued_prefill_tokens and p else 0.0
        a, c, _ = cost.decode_line(b + 1)
        tpot = a + c * (d.decode_kv_tokens + typical_in)
        return (drain + prefill) * stretch, max(tpot, it) * stretch

    # ---------------------------------------------------------------- candidates
    def evaluate(self, snapshot: ClusterSnapshot, candidates: list[GrantLease],
                 horizon_s: float = 1.0) -> list[WhatIfResult]:
        """Predict each candidate independently (against the current snapshot)."""
        with self.same_snapshot():
            return [self._one(snapshot, c, horizon_s) for c in candidates]

    @contextlib.contextmanager
    def same_snapshot(self):
        """Within this block every call is about one snapshot: the devices' own iterations and the other per-device
        terms are computed once (a policy's whole decision runs in one; nested blocks share the outer one)."""
        if self._memo is not None:
            yield
            return
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def _one(self, snap: ClusterSnapshot, cand: GrantLease, horizon_s: float) -> WhatIfResult:
        if cand.mode == "sequences":
            return self._sequences(snap, cand, horizon_s)
        prm = self.params
        home, guest = snap.devices[cand.home_device], snap.devices[cand.guest_device]
        ten = snap.tenants[cand.tenant]
        hcost, gcost = self.cost(ten, home.kind), self.cost(ten, guest.kind)
        local_s, b, p, sampled = self.device_iteration(hcost, home)
        link_kind = snap.link_kind(home.id, guest.id)
        link = load_profile(home.kind).link(link_kind)
        parts, shares = [], []
        for lease in snap.leases_from(home.id):  # leases this engine already holds
            if lease.tenant == cand.tenant and lease.state == "active":
                g = snap.devices[lease.guest_device]
                parts.append(OffloadPart(g.id, len(lease.segments), lease.share,
                                         load_profile(home.kind).link(snap.link_kind(home.id, g.id)),
                                         self.cost(ten, g.kind)))
                idle_share = max(lease.share, 1.0 - g.guest_share + lease.share)
                shares.append(lease.share if (g.busy or g.outstanding) else idle_share)
        base_s = local_s
        mb = self.micro_batch_parts(hcost, home)
        if parts:
            base_s = min(local_s, offloaded_iteration_time(hcost, parts, shares, b, home.decode_kv_tokens, p,
                                                           p * (p + 1) // 2, p, sampled, prm.micro_batches,
                                                           mb).total_s)
        g_share = cand.share if (guest.busy or guest.outstanding) else max(cand.share, 1.0 - guest.guest_share)
        parts.append(OffloadPart(guest.id, len(cand.segments), cand.share, link, gcost))
        shares.append(g_share)
        leased = offloaded_iteration_time(hcost, parts, shares, b, home.decode_kv_tokens, p, p * (p + 1) // 2, p,
                                          sampled, prm.micro_batches, mb)
        new_s = min(base_s, leased.total_s)
        ttft_before, _ = self.tenant_latency(hcost, home, ten, snap.now, base_s, p)
        ttft, tpot = self.tenant_latency(hcost, home, ten, snap.now, new_s, p)
        breaks: list[str] = []
        # the guest's own tenant, with the lease's share taken away (worst case: it is busy the whole window)
        gt_name = guest.home_tenant
        g_ttft = g_tpot = 0.0
        g_ttft, g_tpot, kv_need = self._guest_side(snap, guest, cand.share, horizon_s, breaks)
        seg_bytes = gcost.mlp_weight_bytes
        new_bytes = sum(seg_bytes for s in cand.segments if (cand.tenant, s) not in guest.resident)
        act = 2 * prm.micro_batches * -(-prm.max_batched_tokens // prm.micro_batches) * gcost.hidden_bytes_per_token
        peak = guest.used_bytes + new_bytes + act + kv_need
        if new_bytes + act > guest.free_bytes + guest.evictable_bytes:
            breaks.append("memory_now")
        if peak > guest.limit_bytes + guest.evictable_bytes:
            breaks.append("memory_window")
        if guest.guest_share + cand.share > 0.95:
            breaks.append("share")
        for s in cand.segments:
            if parse_segment(s)[0] != "mlp":
                breaks.append("segment_kind")
                break
        timeline = self._timeline(home, guest, new_s, leased, g_share, horizon_s, snap.now)
        gain = 1.0 - new_s / base_s if base_s > 0 else 0.0
        return WhatIfResult(cand, base_s, new_s, gain, ttft, tpot, ttft_before, g_ttft, g_tpot, peak, timeline, breaks)

    def _guest_side(self, snap: ClusterSnapshot, guest: DeviceState, share: float, horizon_s: float,
                    breaks: list[str]) -> tuple[float, float, int]:
        """Guest tenant's worst-case (TTFT, TPOT) with ``share`` more of its device given away, and the KV it is
        predicted to need over the window; appends broken bounds to ``breaks``."""
        if guest.home_tenant is None:
            return 0.0, 0.0, 0
        gten = snap.tenants[guest.home_tenant]
        gown = self.cost(gten, guest.kind)
        g_ttft, g_tpot = self.guest_latency(gown, guest, gten, guest.guest_share + share)
        if g_ttft > self.params.guest_margin * gten.sla.ttft_ms / 1000.0:
            breaks.append("guest_ttft")
        if g_tpot > self.params.guest_margin * gten.sla.tpot_ms / 1000.0:
            breaks.append("guest_tpot")
        return g_ttft, g_tpot, self._kv_growth(gten, gown, guest, horizon_s)

    def _sequences(self, snap: ClusterSnapshot, cand: GrantLease, horizon_s: float) -> WhatIfResult:
        """A "sequences" lease: part of the tenant's queue runs whole on the guest (full weights staged there)."""
        prm = self.params
        home, guest = snap.devices[cand.home_device], snap.devices[cand.guest_device]
        ten = snap.tenants[cand.tenant]
        hcost, gcost = self.cost(ten, home.kind), self.cost(ten, guest.kind)
        base_s, b, p, _ = self.device_iteration(hcost, home)
        chunk = prm.max_batched_tokens
        own_active = guest.busy or guest.outstanding > 0
        g_eff = cand.share if own_active else max(cand.share, 1.0 - guest.guest_share)
        t_chunk = self._cached(("chunk", id(gcost)),
                               lambda: gcost.iteration_time(0, 0, chunk, chunk * (chunk + 1) // 2, chunk, 1))
        r_g = g_eff * chunk / t_chunk
        r_h = (p / base_s) if p and base_s > 0 else chunk / max(t_chunk, 1e-9)
        frac = r_g / (r_h + r_g)
        ttft_before, _ = self.tenant_latency(hcost, home, ten, snap.now, base_s, p)
        ttft = ttft_before * (1.0 - frac)
        breaks: list[str] = []
        if cand.handback and self.decodes_home(ten, home):
            lane_tpot = base_s  # its sequences only prefill on the guest and decode in the home's batch
        else:
            lane_tpot = self.lane_tpot(snap, ten, guest, cand.share)
            if lane_tpot > prm.guest_margin * ten.sla.tpot_ms / 1000.0:
                breaks.append("lease_tpot")  # the tenant's own sequences would be too slow on the guest's share
        g_ttft, g_tpot, kv_need = self._guest_side(snap, guest, cand.share, horizon_s, breaks)
        new_bytes = 0 if (cand.tenant, "*") in guest.resident else gcost.weight_bytes
        moved_kv = int(ten.rate_rps * horizon_s * frac * (ten.mean_input + ten.mean_output)
                       * gcost.kv_bytes_per_token) + int(home.queued * frac * (ten.mean_input + ten.mean_output)
                                                         * gcost.kv_bytes_per_token)
        peak = guest.used_bytes + new_bytes + kv_need + moved_kv
        if new_bytes > guest.free_bytes + guest.evictable_bytes:
            breaks.append("memory_now")
        if peak > guest.limit_bytes + guest.evictable_bytes:
            breaks.append("memory_window")
        if guest.guest_share + cand.share > 0.95:
            breaks.append("share")
        tl = (snap.now, horizon_s / prm.slots, prm.slots,
              ((home.id, 1.0 if home.outstanding else 0.0), (guest.id, min(1.0, g_eff + (1 - g_eff) * own_active))))
        return WhatIfResult(cand, base_s, base_s * (1.0 - frac), frac, ttft, lane_tpot, ttft_before, g_ttft, g_tpot,
                            peak, tl, breaks)

    def decodes_home(self, ten: TenantState, home: DeviceState) -> bool:
        """Whether a lane that hands its sequences home (lane hand-off) would see them decode in ``home``'s batch:
        the home has memory for the KV its tenant needs soon (:meth:`kv_reserve`), so the hand-off is not refused
        and the lane only prefills. Its requests' TPOT is then the home's, not the lane's."""
        return home.free_bytes + home.evictable_bytes >= self.kv_reserve(ten, home)

    def lane_tpot(self, snap: ClusterSnapshot, ten: TenantState, guest: DeviceState, share: float,
                  batch: int = LANE_BATCH) -> float:
        """Predicted TPOT of ``ten``'s sequences in a lane on ``guest`` holding ``share`` of it, ``batch`` of them
        decoding. While the guest's own tenant decodes, a lane iteration runs at most once between two of its own
        (the guest's TPOT), so a lane token waits for one of those too, whatever the share. A guest tenant idle at
        this instant but with arrivals in the last 30 s counts as decoding one typical request: it will be back
        within the lane's life (a lease granted in a gap of a steady tenant ran its lane at about 1.5× the target)."""
        gcost = self.cost(ten, guest.kind)
        typical = int(ten.mean_input) if ten.mean_input > 0 else 1024
        n = max(1, batch)
        a, c, _ = gcost.decode_line(n)
        lane_it = a + c * n * (typical + ten.mean_output / 2)
        out = lane_it / max(share, 1e-6)
        if guest.home_tenant is None:
            return out
        gten = snap.tenants[guest.home_tenant]
        gown = self.cost(gten, guest.kind)
        own_in = int(gten.mean_input) if gten.mean_input > 0 else 1024
        if guest.busy or guest.outstanding > 0:
            own_it = self.device_iteration(gown, guest)[0]
        elif gten.rate_rps > 0:
            a1, c1, _ = gown.decode_line(1)
            own_it = a1 + c1 * (own_in + gten.mean_output / 2)
        else:
            return out
        # and nothing runs in a lane while the guest's own tenant prefills: the share of the device its prompts take
        chunk = self.params.max_batched_tokens
        prefill_s = self._cached(("prefill", id(gown), own_in), lambda: gown.prefill_time(own_in, chunk))
        prefill_busy = min(0.9, gten.rate_rps / max(1, len(gten.home_devices)) * prefill_s)
        return max(out, (lane_it + own_it) / (1.0 - prefill_busy))

    def kv_reserve(self, t: TenantState, d: DeviceState) -> int:
        """KV the device's own tenant needs soon: its queued requests and one more typical one."""
        cost = self.cost(t, d.kind)
        return int((d.queued + 1) * (t.mean_input + t.mean_output) * cost.kv_bytes_per_token)

    def _kv_growth(self, t: TenantState, cost: ModelCost, d: DeviceState, horizon_s: float) -> int:
        """KV the device's own tenant is predicted to reserve over the window (its queued requests plus its recent
        arrival rate spread over its devices)."""
        per_req = (t.mean_input + t.mean_output) * cost.kv_bytes_per_token
        n_dev = max(1, len(t.home_devices))
        arrivals = t.rate_rps * horizon_s / n_dev
        return int(per_req * (d.queued + arrivals))

    def _timeline(self, home: DeviceState, guest: DeviceState, iter_s: float, leased, g_share: float,
                  horizon_s: float, now: float) -> tuple:
        """Busy fraction per slot over the horizon for the two devices involved (see
        :attr:`WhatIfResult.timeline`)."""
        slots = self.params.slots
        w = horizon_s / slots
        home_busy = 1.0 if (home.running or home.queued) else 0.0
        used = leased.guest_busy_s[-1] / max(g_share, 1e-9) / max(iter_s, 1e-9) if leased.guest_busy_s else 0.0
        guest_own = 1.0 if guest.busy else 0.0
        guest_frac = min(1.0, guest_own * (1.0 - g_share) + min(g_share, used * g_share) if guest_own else
                         min(1.0, used * g_share))
        return now, w, slots, ((home.id, home_busy), (guest.id, guest_frac * home_busy))
