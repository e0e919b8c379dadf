"""Device forecasts: closed-form decode runs agree with iteration-by-iteration sums; idle, arrivals, memory."""
from __future__ import annotations

import pytest

from shared.costmodel import cost_for
from shared.model.config import PRESETS
from services.simulator.forecast import DeviceWork, Seq, forecast_device

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
