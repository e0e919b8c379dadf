"""What-if evaluation of candidate placements against the twin.

``lease`` candidates go to the simulator library's analytical what-if (:class:`shared.sim.whatif.WhatIf`, the same
object the ``slice`` policy uses offline) over the twin's :class:`ClusterSnapshot`; its result is translated into
the RPC's :class:`WhatIfOutcome`. ``admit`` candidates (a request on a device) are costed here from the same cost
model: the request's TTFT is its queue wait plus its prefill iteration, the batch's TPOT is re-costed with it, and
the device's predicted memory peak gains its KV.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel import CorrectionTable
from shared.gmg.snapshot import GMGSnapshot
from shared.messages import DeviceForecast, RequestPrediction, WhatIfCandidate, WhatIfOutcome
from shared.model.graph import parse_segment
from shared.policies.actions import GrantLease
from shared.policies.snapshot import ClusterSnapshot
from shared.sim.steering import CorrectedWhatIf, kind_factors
from shared.sim.whatif import WhatIfResult
from services.simulator.forecast import DeviceWork, Forecast


@dataclass
class TwinView:
    """Everything one evaluation reads: built once per twin refresh, shared by all queries until the next."""

    epoch: int
    snap: GMGSnapshot
    works: dict[str, DeviceWork]
    forecasts: dict[str, Forecast]
    horizon_s: float
    cluster: ClusterSnapshot


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + 1e-9:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class TwinWhatIf(CorrectedWhatIf):
    """The library's what-if with the service's own online correction (per device kind, the mean factor per
    segment kind over the devices of that kind: the same factors the ``sim:steering`` copy gives the scheduler)."""

    def __init__(self, corrections: CorrectionTable, kinds: dict[str, str]) -> None:
        super().__init__()
        self.corrections, self.kinds = corrections, kinds

    def update(self) -> None:
        """Take the correction table's current factors (called once per twin refresh, not per candidate)."""
        self.set_factors(kind_factors(self.corrections, self.kinds))


def _slots_to_busy(slots: list[tuple[float, float, float]], now: float) -> list[tuple[float, float]]:
    """The library's per-slot busy fractions as intervals from now (each slot busy for its fraction, at its start)."""
    return _merge([(s - now, s - now + f * (e - s)) for s, e, f in slots if f > 0])


class WhatIfEvaluator:
    """Evaluates candidates on a :class:`TwinView`."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, corrections: CorrectionTable):
        self.cluster, self.tenants = cluster, tenants
        self.whatif = TwinWhatIf(corrections, {d.id: d.kind for d in cluster.devices})
        self.sla = {t.name: t.sla for t in tenants.tenants}
        self.homes = {t.name: t.home_devices for t in tenants.tenants}

    def evaluate(self, view: TwinView, cands: list[WhatIfCandidate]) -> list[WhatIfOutcome]:
        with self.whatif.same_snapshot():  # one twin view for the whole batch: per-device terms computed once
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
        layers = self.tenants.get(c.tenant).model.config.num_hidden_layers
        if c.mode == "sequences":
            segs = ("*",)
        else:
            for s in c.segments:
                try:
                    kind, layer = parse_segment(s)
                except ValueError:
                    return _bad(index, f"bad_segment:{s}")
                if kind != "mlp" or layer >= layers:
                    return _bad(index, f"bad_segment:{s}")
            segs = tuple(c.segments)
        if not segs or not 0 < c.share <= 1:
            return _bad(index, "bad_lease:segments_or_share")
        g = GrantLease(c.tenant, home, c.device, segs, c.duration_s or view.horizon_s, c.share, c.memory_bytes,
                       mode=c.mode)
        r: WhatIfResult = self.whatif.evaluate(view.cluster, [g], view.horizon_s)[0]
        wh, wg = view.works[home], view.works[c.device]
        gt = wg.tenant
        reasons = [f"{b}:{gt if b.startswith('guest_') else c.tenant if b == 'lease_tpot' else c.device}"
                   for b in r.breaks]
        if not wg.up:
            reasons.append(f"device_down:{c.device}")
        mem_ok = not any(b.startswith("memory") for b in r.breaks)
        sla_ok = not any(b in ("guest_ttft", "guest_tpot", "lease_tpot") for b in r.breaks)
        sla_a = self.sla[c.tenant]
        a_ok = r.tpot_s * 1e3 <= sla_a.tpot_ms or r.tpot_s <= r.home_iter_s
        preds = []
        if wh.seqs:
            preds.append(RequestPrediction([s.request_id for s in wh.seqs], c.tenant, home, 0.0, r.tpot_s * 1e3, a_ok))
        if wh.queued:
            preds.append(RequestPrediction([f"queued:{c.tenant}"], c.tenant, home, r.ttft_s * 1e3, r.tpot_s * 1e3,
                                           r.ttft_s * 1e3 <= sla_a.ttft_ms or r.ttft_s <= r.ttft_before_s))
        if gt:
            g_ok = "guest_tpot" not in r.breaks
            if wg.seqs:
                preds.append(RequestPrediction([s.request_id for s in wg.seqs], gt, c.device, 0.0,
                                               r.guest_tpot_s * 1e3, g_ok))
            preds.append(RequestPrediction([f"typical:{gt}"], gt, c.device, r.guest_ttft_s * 1e3,
                                           r.guest_tpot_s * 1e3, g_ok and "guest_ttft" not in r.breaks))
        now, fh = view.cluster.now, view.forecasts[home]
        devices = [DeviceForecast(home, _slots_to_busy(r.busy_timeline.get(home, []), now), fh.peak_bytes, fh.limit),
                   DeviceForecast(c.device, _slots_to_busy(r.busy_timeline.get(c.device, []), now),
                                  r.guest_memory_peak_bytes, wg.limit)]
        return WhatIfOutcome(index=index, feasible=r.ok and wg.up, memory_ok=mem_ok, sla_ok=sla_ok, reasons=reasons,
                             gain_ms=(r.home_iter_s - r.leased_iter_s) * 1e3, requests=preds, devices=devices)

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
        preds = [RequestPrediction([c.request_id or "candidate"], c.tenant, c.device, ttft * 1e3, tpot * 1e3, own_ok)]
        if w.seqs:
            preds.append(RequestPrediction([s.request_id for s in w.seqs], c.tenant, c.device, 0.0, tpot * 1e3,
                                           others_ok))
        busy = _merge(f.busy + [(0.0, min(ttft, view.horizon_s))])
        sla_ok = own_ok and others_ok
        return WhatIfOutcome(index=index, feasible=mem_ok and sla_ok and w.up, memory_ok=mem_ok, sla_ok=sla_ok,
                             reasons=reasons, requests=preds,
                             devices=[DeviceForecast(c.device, busy, peak, w.limit)])


def _bad(index: int, reason: str) -> WhatIfOutcome:
    return WhatIfOutcome(index=index, feasible=False, memory_ok=False, sla_ok=False, reasons=[reason])
