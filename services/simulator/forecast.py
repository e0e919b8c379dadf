"""Per-device forecast over a short horizon: when the device will be busy or idle and how much memory it will
hold, from its running requests, its queue and its tenant's arrival rate.

A fluid model at iteration granularity (DESIGN §5): prefill chunks run as single iterations; between events
(a sequence finishes, a request arrives, the horizon ends) a run of decode-only iterations advances in closed form
with the cost model's decode line ``a + c*K``. Pure: no clock, no Redis.
"""
from __future__ import annotations

import heapq
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
    """Forecast one device (see module doc). A device that is down or has no model is idle with constant memory.

    Every running sequence advances one token per iteration, so the sequences are kept as a heap of finish points
    on one shared token clock ``g`` plus running sums: an event costs O(log n), not a pass over every sequence.
    """
    reserved, peak = w.reserved, w.reserved
    memory = [(0.0, reserved)]
    busy: list[tuple[float, float]] = []
    finishes: dict[str, float] = {}
    cost = w.cost
    if cost is None or not w.up:
        return Forecast(w.device, horizon_s, [], memory, peak, w.limit, 0.0)
    # a sequence that joined at token clock g0 with context c0 has context c0 + (g - g0) now and finishes at
    # g0 + remaining; ctx_base = sum of (c0 - g0) over the live ones, so their total context is ctx_base + n * g
    heap = [(max(1, s.remaining), i, s.request_id, s.kv_bytes, s.ctx) for i, s in enumerate(w.seqs)]
    heapq.heapify(heap)
    ctx_base = sum(s.ctx for s in w.seqs)
    g, seq_no = 0, len(heap)
    mi, mo = max(1, int(w.mean_input)), max(1, int(w.mean_output))
    per_req_kv = (mi + mo) * w.kv_bytes_per_token
    queue = [mi] * w.queued  # remaining prompt tokens of queued requests (their KV is reserved at admission)
    gap = 1.0 / w.rate_rps if w.rate_rps > 0 else math.inf
    next_arrival = gap
    iteration_s = cost.iteration_time(len(heap), ctx_base) if heap else 0.0
    t, events, new_id = 0.0, 0, 0
    while t < horizon_s and events < max_events:
        events += 1
        while next_arrival <= t:
            queue.append(mi)
            reserved += per_req_kv
            memory.append((next_arrival, reserved))
            next_arrival += gap
        peak = max(peak, reserved)
        n = len(heap)
        if queue and n < w.max_num_seqs:
            # one mixed iteration: decode tokens plus a prefill chunk of the queue's head
            budget = max(1, w.max_batched_tokens - n)
            q = min(queue[0], budget)
            done = mi - queue[0]
            pairs = q * done + q * (q + 1) // 2
            last = q >= queue[0]
            dt = cost.iteration_time(n, ctx_base + n * g, q, pairs, done + q, sampled=n + (1 if last else 0))
            _add_busy(busy, t, min(t + dt, horizon_s))
            t += dt
            g += 1
            queue[0] -= q
            if last:
                queue.pop(0)
                new_id += 1
                heapq.heappush(heap, (g + mo - 1, seq_no, f"+{new_id}", per_req_kv, mi + 1 - g))
                seq_no += 1
                ctx_base += mi + 1 - g
        elif heap:
            kv = ctx_base + n * g
            k = heap[0][0] - g
            a, c, _ = cost.decode_line(n)
            per_it = a + c * kv
            if next_arrival < horizon_s:
                k = max(1, min(k, math.ceil((next_arrival - t) / max(per_it, 1e-9))))
            k = max(1, min(k, math.ceil((horizon_s - t) / max(per_it, 1e-9))))
            dt = _decode_run(cost, n, kv, k)
            _add_busy(busy, t, min(t + dt, horizon_s))
            t += dt
            g += k
        else:
            t = min(next_arrival, horizon_s)
            continue
        freed = False
        while heap and heap[0][0] <= g:
            _, _, rid, kv_bytes, base = heapq.heappop(heap)
            finishes[rid] = t
            reserved -= kv_bytes
            ctx_base -= base
            freed = True
        if freed:
            memory.append((min(t, horizon_s), reserved))
    return Forecast(w.device, horizon_s, busy, memory, peak, w.limit, iteration_s, finishes)
