"""Decisions of the simulator service as a plain object: the twin, forecasts, online correction, what-if answers.

No Redis here. The service feeds it GMG snapshots (from the follower), requests (arrival rates and lengths) and
worker events (measured segment times), and asks it for forecast hashes and what-if replies.
"""
from __future__ import annotations

import time
import uuid

from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel import CorrectionTable, cost_for
from shared.gmg.snapshot import GMGSnapshot
from shared.messages import (InferenceRequest, RequestFinished, StepReport, WhatIfQuery, WhatIfReply)
from shared.model.graph import parse_segment
from shared.sim.steering import SteeringCopy, kind_factors
from services.simulator.evaluate import TwinView, WhatIfEvaluator
from services.simulator.forecast import Forecast, forecast_device
from services.simulator.twin import RateEstimator, ReqInfo, RequestBook, Twin

HORIZON_S = 2.0
MAX_CANDIDATES = 64
TIMELINE_POINTS = 32


class SimulatorCore:
    """The twin plus everything the service publishes or answers."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, *, horizon_s: float = HORIZON_S,
                 rate_window_s: float = 10.0) -> None:
        self.cluster, self.tenants, self.horizon_s = cluster, tenants, horizon_s
        self.kinds = {d.id: d.kind for d in cluster.devices}
        self.corrections = CorrectionTable()
        self.twin = Twin(cluster, tenants, book=RequestBook(), rates=RateEstimator(rate_window_s),
                         corrections=self.corrections)
        self.evaluator = WhatIfEvaluator(cluster, tenants, self.corrections)
        self.view: TwinView | None = None
        self.view_ts = 0.0

    # ------------------------------------------------------------ inputs
    def on_request(self, req: InferenceRequest) -> None:
        ts = req.arrival_ts or time.time()
        self.twin.book.add(req.request_id, ReqInfo(req.tenant, len(req.prompt_ids), req.max_tokens, ts))
        self.twin.rates.observe_arrival(req.tenant, ts, len(req.prompt_ids), req.max_tokens)

    def on_event(self, msg) -> list[tuple[str, str, float]]:
        """Apply one worker event; returns (device, segment kind, current error) for every correction updated."""
        if isinstance(msg, RequestFinished):
            self.twin.rates.observe_output(msg.tenant, msg.completion_tokens)
            return []
        if not isinstance(msg, StepReport) or msg.device not in self.kinds:
            return []
        try:
            cfg = self.tenants.get(msg.tenant).model.config
        except KeyError:
            return []
        cost = cost_for(cfg, self.kinds[msg.device])  # uncorrected: the factor learns measured / model
        touched = set()
        for st in msg.segments:
            if st.count <= 0:
                continue
            try:
                kind, _ = parse_segment(st.segment)
            except ValueError:
                continue
            t = st.tokens_bucket
            if kind == "mlp":
                pred = cost.mlp_time(t)
            elif kind == "attn":
                pred = cost.attn_dense_time(t) + (cost.decode_attention_time(t, t * st.kv_tokens) if st.kv_tokens else 0.0)
            elif kind == "embed":
                pred = cost.embed_time(t)
            else:
                pred = cost.head_time(t)
            measured = st.total_ms / st.count / 1e3
            self.corrections.observe(msg.device, kind, pred, measured)
            self.corrections.observe(msg.device, f"{kind}@{t}", pred, measured)  # this shape bucket's own factor
            touched.add(kind)
        return [(msg.device, k, self.corrections.error(msg.device, k)) for k in sorted(touched)]

    # ------------------------------------------------------------ twin refresh
    def refresh(self, snap: GMGSnapshot, now: float) -> TwinView:
        """Rebuild per-device work and baseline forecasts for ``snap``."""
        self.evaluator.whatif.update()
        works = self.twin.device_work(snap, now)
        forecasts = {d: forecast_device(w, self.horizon_s) for d, w in works.items()}
        self.view = TwinView(snap.epoch, snap, works, forecasts, self.horizon_s,
                             self.twin.cluster_snapshot(snap, works, now))
        self.view_ts = now
        return self.view

    # ------------------------------------------------------------ outputs
    def answer(self, q: WhatIfQuery, now: float) -> WhatIfReply:
        """Evaluate the query's candidates on the current twin."""
        t0 = time.perf_counter()
        if self.view is None:
            return WhatIfReply(msg_id=uuid.uuid4().hex, query_id=q.query_id, epoch=-1, error="twin_not_ready")
        if len(q.candidates) > MAX_CANDIDATES:
            return WhatIfReply(msg_id=uuid.uuid4().hex, query_id=q.query_id, epoch=self.view.epoch,
                               error=f"too_many_candidates: {len(q.candidates)} > {MAX_CANDIDATES}")
        outcomes = self.evaluator.evaluate(self.view, q.candidates)
        return WhatIfReply(msg_id=uuid.uuid4().hex, query_id=q.query_id, epoch=self.view.epoch, outcomes=outcomes,
                           compute_ms=(time.perf_counter() - t0) * 1e3)

    def forecast_devices(self) -> list[str]:
        """Devices with a forecast in the current view."""
        return list(self.view.forecasts) if self.view is not None else []

    def forecast_fields_of(self, d: str, now: float) -> dict[str, str]:
        """The ``sim:forecast:{device}`` hash of one device (plain fields; see docs/redis-schema.md)."""
        f, w = self.view.forecasts[d], self.view.works[d]
        idle = f.idle()
        return {"ts": f"{now:.3f}", "epoch": str(self.view.epoch), "horizon_s": f"{f.horizon_s:g}",
                "label": "simulated", "state": "up" if w.up else "down", "tenant": w.tenant,
                "busy_s": f"{f.busy_s:.4f}", "busy_ratio": f"{f.busy_s / f.horizon_s:.3f}",
                "busy": _intervals(f.busy), "idle": _intervals(idle),
                "next_idle_s": f"{idle[0][0]:.4f}" if idle else f"{f.horizon_s:g}",
                "longest_idle_s": f"{max((e - s for s, e in idle), default=0.0):.4f}",
                "iteration_ms": f"{f.iteration_s * 1e3:.3f}", "limit": str(f.limit),
                "free_now": str(f.limit - w.reserved), "free_min": str(f.min_free()),
                "peak_bytes": str(f.peak_bytes), "memory": _memory(f)}

    def forecast_fields(self, now: float) -> dict[str, dict[str, str]]:
        """Every device's ``sim:forecast:{device}`` hash."""
        return {d: self.forecast_fields_of(d, now) for d in self.forecast_devices()}

    def rates_fields(self, now: float) -> dict[str, str]:
        """The ``sim:rates`` hash: ``<tenant>`` = arrivals/s, ``<tenant>:mean_input``/``:mean_output`` tokens."""
        out = {"ts": f"{now:.3f}", "window_s": f"{self.twin.rates.window_s:g}"}
        for t in self.tenants.names():
            mi, mo = self.twin.means(t)
            out[t] = f"{self.twin.rates.rate(t, now):.4f}"
            out[f"{t}:mean_input"], out[f"{t}:mean_output"] = f"{mi:.1f}", f"{mo:.1f}"
        return out

    def steering_copy(self, version: int, now: float) -> SteeringCopy:
        """What the scheduler's what-if takes from this service (``sim:steering``): the correction factors per
        device kind and, per device of the current view, the forecast busy ratio and time to the next idle slice."""
        busy, idle = {}, {}
        if self.view is not None:
            for d, f in self.view.forecasts.items():
                gaps = f.idle()
                busy[d] = f.busy_s / f.horizon_s if f.horizon_s > 0 else 0.0
                idle[d] = gaps[0][0] if gaps else f.horizon_s
        return SteeringCopy(version=version, ts=now, epoch=self.view.epoch if self.view is not None else -1,
                            horizon_s=self.horizon_s, factors=kind_factors(self.corrections, self.kinds),
                            busy=busy, next_idle_s=idle)

    def corrections_fields(self) -> dict[str, str]:
        """The ``sim:corrections`` hash: ``<device>/<kind>`` = ``factor|error|samples``."""
        return {k: f"{v['factor']:.4f}|{v['error']:.4f}|{v['samples']}"
                for k, v in self.corrections.snapshot().items()}


def _intervals(xs: list[tuple[float, float]]) -> str:
    return ",".join(f"{s:.3f}-{e:.3f}" for s, e in xs[:64])


def _memory(f: Forecast) -> str:
    pts = f.memory
    if len(pts) > TIMELINE_POINTS:
        step = len(pts) / TIMELINE_POINTS
        pts = [pts[int(i * step)] for i in range(TIMELINE_POINTS)] + [pts[-1]]
    return ",".join(f"{t:.3f}:{b}" for t, b in pts)
