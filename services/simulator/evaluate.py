"""What-if evaluation of candidate placements against the twin (analytical, per candidate O(affected devices)).

For a ``lease`` candidate the tenant's home iteration is re-costed with the offloaded segments
(:func:`shared.sim.offload.offloaded_iteration_time`, pipelined micro-batches); the guest's own tenant loses at most
the lease's share of the guest's time plus one segment of preemption delay; the guest's memory peak over the
horizon gains the lease buffers and the staging of segments not yet resident. For an ``admit`` candidate the
request's TTFT is its queue wait plus its prefill iteration, and the batch's TPOT is re-costed with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel.profiles import DeviceProfile
from shared.gmg.snapshot import GMGSnapshot
from shared.messages import DeviceForecast, RequestPrediction, WhatIfCandidate, WhatIfOutcome
from shared.model.graph import parse_segment
from shared.sim.offload import OffloadPart, offloaded_iteration_time
from services.simulator.forecast import DeviceWork, Forecast

MICRO_BATCHES = 2


@dataclass
class TwinView:
    """Everything one evaluation reads: built once per twin refresh, shared by all queries until the next."""

    epoch: int
    snap: GMGSnapshot
    works: dict[str, DeviceWork]
    forecasts: dict[str, Forecast]
    horizon_s: float


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + 1e-9:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _fill_idle(f: Forecast, need_s: float, until: float) -> list[tuple[float, float]]:
    """Busy intervals of ``f`` plus ``need_s`` seconds of guest work placed in its idle gaps before ``until``."""
    extra = []
    for s, e in f.idle():
        if need_s <= 0 or s >= until:
            break
        take = min(need_s, min(e, until) - s)
        extra.append((s, s + take))
        need_s -= take
    return _merge(f.busy + extra)


class WhatIfEvaluator:
    """Evaluates candidates on a :class:`TwinView`; ``cost(tenant, device)`` gives corrected ModelCosts."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, cost, profiles: dict[str, DeviceProfile]):
        self.cluster, self.tenants, self.cost, self.profiles = cluster, tenants, cost, profiles
        self.sla = {t.name: t.sla for t in tenants.tenants}
        self.homes = {t.name: t.home_devices for t in tenants.tenants}

    def evaluate(self, view: TwinView, cands: list[WhatIfCandidate]) -> list[WhatIfOutcome]:
        return [self.one(view, i, c) for i, c in enumerate(cands)]

    def one(self, view: TwinView, index: int, c: WhatIfCandidate) -> WhatIfOutcome:
        if c.tenant not in self.sla:
            return _bad(index, f"unknown_tenant:{c.tenant}")
        if c.device not in view.works:
            return _bad(index, f"unknown_device:{c.device}")
        if c.kind == "lease":
            return self._lease(view, index, c)
        if c.kind == "admit":
            return self._admit(view, index, c)
        return _bad(index, f"unknown_kind:{c.kind}")

    # ------------------------------------------------------------ lease
    def _lease(self, view: TwinView, index: int, c: WhatIfCandidate) -> WhatIfOutcome:
        home = c.home_device or (self.homes[c.tenant][0] if self.homes[c.tenant] else "")
        if home not in view.works or home == c.device:
            return _bad(index, f"bad_home:{home}")
        wh, wg = view.works[home], view.works[c.device]
        ca, cg = self.cost(c.tenant, home), self.cost(c.tenant, c.device)
        layers = ca.layers
        for s in c.segments:
            try:
                kind, layer = parse_segment(s)
            except ValueError:
                return _bad(index, f"bad_segment:{s}")
            if kind != "mlp" or layer >= layers:
                return _bad(index, f"bad_segment:{s}")
        if not c.segments or not 0 < c.share <= 1:
            return _bad(index, "bad_lease:segments_or_share")
        reasons: list[str] = []
        if not wg.up:
            reasons.append(f"device_down:{c.device}")
        fh, fg = view.forecasts[home], view.forecasts[c.device]
        window = min(view.horizon_s, c.duration_s or view.horizon_s)
        # memory on the guest: buffers plus staging of segments it does not hold yet
        resident = view.snap.resident.get(c.device, {})
        staging = sum(cg.mlp_weight_bytes for s in c.segments if (c.tenant, s) not in resident)
        peak_g = fg.peak_bytes + c.memory_bytes + staging
        mem_ok = peak_g <= wg.limit
        if not mem_ok:
            reasons.append(f"memory:{c.device}")
        # the home's iteration with the segments offloaded
        n, kv = len(wh.seqs), sum(s.ctx for s in wh.seqs)
        idle_frac = max(0.0, 1.0 - fg.busy_s / max(fg.horizon_s, 1e-9))
        avail = idle_frac + (1.0 - idle_frac) * c.share
        link_kind = self.cluster.link_kind(home, c.device)
        part = OffloadPart(c.device, len(c.segments), c.share, self.profiles[home].link(link_kind), cg)
        preds: list[RequestPrediction] = []
        gain_ms, demand = 0.0, 0.0
        sla_a, sla_b = self.sla[c.tenant], self.sla.get(wg.tenant)
        sla_ok = True
        if n:
            before = ca.iteration_time(n, kv)
            t = offloaded_iteration_time(ca, [part], [avail], n, kv, micro_batches=MICRO_BATCHES)
            after = t.total_s
            gain_ms = (before - after) * 1e3
            demand = t.guest_busy_s[0] / max(after, 1e-12)
            ok = after * 1e3 <= sla_a.tpot_ms or after <= before
            sla_ok &= ok
            if not ok:
                reasons.append(f"sla_tpot:{c.tenant}")
            preds += [RequestPrediction(s.request_id, c.tenant, home, 0.0, after * 1e3, ok) for s in wh.seqs]
        # the guest's own tenant: loses min(share, demand) of its time while busy, plus one segment of preemption
        nb = len(wg.seqs)
        if nb and sla_b is not None and wg.cost is not None:
            tm = -(-max(n, 1) // MICRO_BATCHES)
            b_before = fg.iteration_s
            b_after = b_before / max(1e-6, 1.0 - min(c.share, demand)) + cg.mlp_time(tm)
            ok = b_after * 1e3 <= sla_b.tpot_ms or b_before * 1e3 > sla_b.tpot_ms
            sla_ok &= ok
            if not ok:
                reasons.append(f"sla_tpot:{wg.tenant}")
            preds += [RequestPrediction(s.request_id, wg.tenant, c.device, 0.0, b_after * 1e3, ok) for s in wg.seqs]
        guest_busy = _fill_idle(fg, demand * window, window)
        devices = [DeviceForecast(home, fh.busy, fh.peak_bytes, fh.limit),
                   DeviceForecast(c.device, guest_busy, peak_g, wg.limit)]
        return WhatIfOutcome(index=index, feasible=mem_ok and sla_ok and wg.up, memory_ok=mem_ok, sla_ok=sla_ok,
                             reasons=reasons, gain_ms=gain_ms, requests=preds, devices=devices)

    # ------------------------------------------------------------ admit
    def _admit(self, view: TwinView, index: int, c: WhatIfCandidate) -> WhatIfOutcome:
        w, f = view.works[c.device], view.forecasts[c.device]
        if w.tenant != c.tenant or w.cost is None:
            return _bad(index, f"no_engine:{c.tenant}@{c.device}")
        cost, sla = w.cost, self.sla[c.tenant]
        inp, out = max(1, c.input_tokens), max(1, c.output_tokens)
        n, kv = len(w.seqs), sum(s.ctx for s in w.seqs)
        wait = w.queued * cost.prefill_time(int(w.mean_input)) if w.queued else 0.0
        prefill = cost.iteration_time(n, kv, inp, inp * (inp + 1) // 2, inp, sampled=n + 1)
        ttft = wait + prefill
        before = cost.iteration_time(n, kv) if n else 0.0
        tpot = cost.iteration_time(n + 1, kv + inp)
        kv_bytes = (inp + out) * w.kv_bytes_per_token
        peak = f.peak_bytes + kv_bytes
        reasons = []
        mem_ok = peak <= w.limit
        if not mem_ok:
            reasons.append(f"memory:{c.device}")
        if not w.up:
            reasons.append(f"device_down:{c.device}")
        own_ok = ttft * 1e3 <= sla.ttft_ms and tpot * 1e3 <= sla.tpot_ms
        others_ok = tpot * 1e3 <= sla.tpot_ms or before * 1e3 > sla.tpot_ms
        if ttft * 1e3 > sla.ttft_ms:
            reasons.append(f"sla_ttft:{c.tenant}")
        if tpot * 1e3 > sla.tpot_ms:
            reasons.append(f"sla_tpot:{c.tenant}")
        preds = [RequestPrediction(c.request_id or "candidate", c.tenant, c.device, ttft * 1e3, tpot * 1e3, own_ok)]
        preds += [RequestPrediction(s.request_id, c.tenant, c.device, 0.0, tpot * 1e3, others_ok) for s in w.seqs]
        busy = _merge(f.busy + [(0.0, min(ttft, view.horizon_s))])
        sla_ok = own_ok and others_ok
        return WhatIfOutcome(index=index, feasible=mem_ok and sla_ok and w.up, memory_ok=mem_ok, sla_ok=sla_ok,
                             reasons=reasons, requests=preds,
                             devices=[DeviceForecast(c.device, busy, peak, w.limit)])


def _bad(index: int, reason: str) -> WhatIfOutcome:
    return WhatIfOutcome(index=index, feasible=False, memory_ok=False, sla_ok=False, reasons=[reason])
