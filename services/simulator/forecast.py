"""Per-device forecast over a short horizon: when the device will be busy or idle and how much memory it will
hold, from its running requests, its queue and its tenant's arrival rate.

A fluid model at iteration granularity (DESIGN §5): prefill chunks run as single iterations; between events
(a sequence finishes, a request arrives, the horizon ends) a run of decode-only iterations advances in closed form
with the cost model's decode line ``a + c*K``. Pure: no clock, no Redis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.costmodel.model_cost import ModelCost


@dataclass
class Seq:
    """A running sequence: context so far, tokens still to generate, KV bytes it holds."""

    request_id: str
    ctx: int
    remaining: int
    kv_bytes: int


@dataclass
class DeviceWork:
    """What the twin knows of one device's work now (built by :mod:`services.simulator.twin`)."""

    device: str
    tenant: str  # home tenant ("" if none)
    cost: ModelCost | None
    limit: int
    reserved: int
    seqs: list[Seq] = field(default_factory=list)
    queued: int = 0
    rate_rps: float = 0.0  # arrivals routed to this device
    mean_input: float = 512.0
    mean_output: float = 128.0
    kv_bytes_per_token: int = 0
    up: bool = True
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256


@dataclass
class Forecast:
    """Busy intervals and reserved memory over [0, horizon_s) seconds from now."""

    device: str
    horizon_s: float
    busy: list[tuple[float, float]]
    memory: list[tuple[float, int]]  # (t, reserved bytes) at each change
    peak_bytes: int
    limit: int
    iteration_s: float  # predicted time of the current iteration (≈ TPOT of its running requests)
    finishes: dict[str, float] = field(default_factory=dict)  # request_id -> predicted finish time

    @property
    def busy_s(self) -> float:
        return sum(e - s for s, e in self.busy)

    def idle(self) -> list[tuple[float, float]]:
        """Idle intervals (the complement of ``busy`` within the horizon)."""
        out, t = [], 0.0
        for s, e in self.busy:
            if s > t:
                out.append((t, s))
            t = max(t, e)
        if t < self.horizon_s:
            out.append((t, self.horizon_s))
        return out

    def min_free(self) -> int:
        return self.limit - self.peak_bytes


def _add_busy(busy: list[tuple[float, float]], s: float, e: float) -> None:
    if e <= s:
        return
    if busy and s - busy[-1][1] < 1e-6:
        busy[-1] = (busy[-1][0], e)
    else:
        busy.append((s, e))


def _decode_run(cost: ModelCost, n: int, kv: int, k: int) -> float:
    """Time of ``k`` decode iterations of ``n`` sequences starting at total context ``kv``."""
    a, c, kmax = cost.decode_line(n)
    end_kv = kv + n * (k - 1)
    if end_kv <= kmax:
        return k * a + c * (k * kv + n * k * (k - 1) / 2)
    return sum(cost.iteration_time(n, kv + n * i) for i in range(k))


def forecast_device(w: DeviceWork, horizon_s: float, *, max_events: int = 512) -> Forecast:
    """Forecast one device (see module doc). A device that is down or has no model is idle with constant memory."""
    reserved, peak = w.reserved, w.reserved
    memory = [(0.0, reserved)]
    busy: list[tuple[float, float]] = []
    finishes: dict[str, float] = {}
    cost = w.cost
    if cost is None or not w.up:
        return Forecast(w.device, horizon_s, [], memory, peak, w.limit, 0.0)
    seqs = [Seq(s.request_id, s.ctx, max(1, s.remaining), s.kv_bytes) for s in w.seqs]
    mi, mo = max(1, int(w.mean_input)), max(1, int(w.mean_output))
    per_req_kv = (mi + mo) * w.kv_bytes_per_token
    queue = [mi] * w.queued  # remaining prompt tokens of queued requests (their KV is reserved at admission)
    gap = 1.0 / w.rate_rps if w.rate_rps > 0 else math.inf
    next_arrival = gap
    n0 = len(seqs)
    iteration_s = cost.iteration_time(n0, sum(s.ctx for s in seqs)) if n0 else 0.0
    t, events, new_id = 0.0, 0, 0
    while t < horizon_s and events < max_events:
        events += 1
        while next_arrival <= t:
            queue.append(mi)
            reserved += per_req_kv
            memory.append((next_arrival, reserved))
            next_arrival += gap
        peak = max(peak, reserved)
        if queue and len(seqs) < w.max_num_seqs:
            # one mixed iteration: decode tokens plus a prefill chunk of the queue's head
            budget = max(1, w.max_batched_tokens - len(seqs))
            q = min(queue[0], budget)
            done = mi - queue[0]
            kv = sum(s.ctx for s in seqs)
            pairs = q * done + q * (q + 1) // 2
            last = q >= queue[0]
            dt = cost.iteration_time(len(seqs), kv, q, pairs, done + q, sampled=len(seqs) + (1 if last else 0))
            _add_busy(busy, t, min(t + dt, horizon_s))
            t += dt
            for s in seqs:
                s.ctx += 1
                s.remaining -= 1
            queue[0] -= q
            if last:
                queue.pop(0)
                new_id += 1
                seqs.append(Seq(f"+{new_id}", mi + 1, mo - 1, per_req_kv))
        elif seqs:
            n, kv = len(seqs), sum(s.ctx for s in seqs)
            k = min(s.remaining for s in seqs)
            a, c, _ = cost.decode_line(n)
            per_it = a + c * kv
            if next_arrival < horizon_s:
                k = max(1, min(k, math.ceil((next_arrival - t) / max(per_it, 1e-9))))
            k = max(1, min(k, math.ceil((horizon_s - t) / max(per_it, 1e-9))))
            dt = _decode_run(cost, n, kv, k)
            _add_busy(busy, t, min(t + dt, horizon_s))
            t += dt
            for s in seqs:
                s.ctx += k
                s.remaining -= k
        else:
            t = min(next_arrival, horizon_s)
            continue
        alive = []
        for s in seqs:
            if s.remaining > 0:
                alive.append(s)
            else:
                finishes[s.request_id] = t
                reserved -= s.kv_bytes
        if len(alive) != len(seqs):
            memory.append((min(t, horizon_s), reserved))
        seqs = alive
    return Forecast(w.device, horizon_s, busy, memory, peak, w.limit, iteration_s, finishes)
