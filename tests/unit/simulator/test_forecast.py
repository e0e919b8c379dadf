"""Device forecasts: closed-form decode runs agree with iteration-by-iteration sums; idle, arrivals, memory."""
from __future__ import annotations

import math
import random

import pytest

from shared.costmodel import cost_for
from shared.model.config import PRESETS
from services.simulator.forecast import DeviceWork, Forecast, Seq, _add_busy, _decode_run, forecast_device

COST = cost_for(PRESETS["llama-7b"], "h100-80gb")
KVPT = PRESETS["llama-7b"].kv_bytes_per_token()
GIB = 2**30


def _work(seqs, **kw) -> DeviceWork:
    base = dict(device="g0", tenant="t", cost=COST, limit=76 * GIB, reserved=13 * GIB + sum(s.kv_bytes for s in seqs),
                seqs=seqs, kv_bytes_per_token=KVPT, mean_input=1000, mean_output=100)
    base.update(kw)
    return DeviceWork(**base)


def test_finish_times_match_step_by_step_sum():
    seqs = [Seq(f"r{i}", 500 + 10 * i, 20 + 7 * i, 1000 * KVPT) for i in range(5)]
    f = forecast_device(_work([Seq(s.request_id, s.ctx, s.remaining, s.kv_bytes) for s in seqs]), 10.0)
    # reference: one iteration at a time
    t, live, expect = 0.0, [[s.request_id, s.ctx, s.remaining] for s in seqs], {}
    while live:
        t += COST.iteration_time(len(live), sum(x[1] for x in live))
        for x in live:
            x[1] += 1
            x[2] -= 1
        for x in [x for x in live if x[2] == 0]:
            expect[x[0]] = t
            live.remove(x)
    assert f.finishes.keys() == expect.keys()
    for rid, ts in expect.items():
        assert f.finishes[rid] == pytest.approx(ts, rel=1e-9)
    assert f.busy == [(0.0, pytest.approx(max(expect.values())))]
    assert f.memory[-1][1] == 13 * GIB  # every sequence's KV freed by the end
    assert f.peak_bytes == 13 * GIB + 5 * 1000 * KVPT


def test_idle_device_and_down_device():
    f = forecast_device(_work([]), 2.0)
    assert f.busy == [] and f.idle() == [(0.0, 2.0)] and f.peak_bytes == 13 * GIB
    down = forecast_device(_work([Seq("r", 100, 50, KVPT)], up=False), 2.0)
    assert down.busy == [] and down.iteration_s == 0.0


def test_arrivals_make_busy_bursts_and_grow_memory():
    f = forecast_device(_work([], rate_rps=4.0, mean_input=800, mean_output=20), 2.0)
    assert len(f.busy) >= 6  # a burst per arrival (every 0.25 s), idle between them
    assert all(0.25 * i <= s for i, (s, _e) in enumerate(f.busy, start=1))
    assert 0 < f.busy_s < 2.0 and f.idle()[0] == (0.0, 0.25)
    assert f.peak_bytes == 13 * GIB + (800 + 20) * KVPT  # one request in flight at a time
    assert f.min_free() == 76 * GIB - f.peak_bytes


def test_queue_is_prefilled_before_decoding():
    f = forecast_device(_work([], queued=2, mean_input=1000, mean_output=10), 5.0)
    first = COST.iteration_time(0, 0, 1000, 1000 * 1001 // 2, 1000, sampled=1)
    assert f.busy[0][0] == 0.0 and f.busy[0][1] > first
    assert len(f.finishes) == 2


# ---------------------------------------------------------------- the heap of finish points against the plain loop
def _reference(w: DeviceWork, horizon_s: float, *, max_events: int = 512) -> Forecast:
    """The forecast one sequence at a time (every running sequence updated every event): the oracle."""
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


@pytest.mark.parametrize("seed", range(12))
def test_heap_forecast_equals_the_per_sequence_loop(seed):
    rng = random.Random(seed)
    seqs = [Seq(f"r{i}", rng.randint(1, 3000), rng.randint(0, 400), rng.randint(1, 4000) * KVPT)
            for i in range(rng.randint(0, 64))]
    w = _work(seqs, queued=rng.randint(0, 4), rate_rps=rng.choice([0.0, 2.0, 15.0, 60.0]),
              mean_input=rng.randint(16, 2048), mean_output=rng.choice([1, 2, 30, 250]),
              max_num_seqs=rng.choice([8, 64, 256]), max_batched_tokens=rng.choice([256, 2048]))
    cap = rng.choice([64, 512])
    got, ref = forecast_device(w, 2.0, max_events=cap), _reference(w, 2.0, max_events=cap)
    assert got.busy == ref.busy
    assert got.memory == ref.memory
    assert got.finishes == ref.finishes
    assert (got.peak_bytes, got.iteration_s) == (ref.peak_bytes, ref.iteration_s)
