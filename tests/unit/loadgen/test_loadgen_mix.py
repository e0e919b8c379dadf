"""Arrival mixing: popularity, circular offsets, tiling, thinning/replication, rate scale, length caps."""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.mix import TenantPlan, build_requests, cap_lengths, popularity_weights, tenant_arrivals
from loadgen.traces import make_trace


def poisson_trace(rate: float, span: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, int(rate * span * 1.2)))
    t = t[t < span]
    n = t.size
    return make_trace("p", "<memory>", t, rng.integers(10, 100, n), rng.integers(1, 50, n))


def test_popularity_weights_follow_power_law():
    w = popularity_weights(4, 1.3)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[3] == pytest.approx(4 ** 1.3)
    assert np.allclose(popularity_weights(3, 0.0), 1 / 3)


def test_offset_is_a_circular_shift():
    tr = make_trace("t", "<memory>", np.array([0.0, 1.0, 2.0, 3.0]), np.full(4, 5), np.full(4, 2))
    assert tr.period_s == 4.0
    plan = TenantPlan("a", tr, target_rate_rps=tr.rate_rps, offset_s=1.0, context=100)
    t, inp, out = tenant_arrivals(plan, 1.0, 8.0, np.random.default_rng(0))
    # trace time 1 comes first, trace time 0 wraps to the end, then the trace repeats
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_thinning_replication_and_rate_scale():
    tr = poisson_trace(10.0, 100.0)
    rng = np.random.default_rng(1)
    thin = tenant_arrivals(TenantPlan("a", tr, 2.5, 0.0, 10_000), 1.0, 100.0, rng)[0]
    assert thin.size == pytest.approx(250, rel=0.15)
    rep = tenant_arrivals(TenantPlan("a", tr, 25.0, 0.0, 10_000), 1.0, 100.0, rng)[0]
    assert rep.size == pytest.approx(2500, rel=0.05)
    assert np.all(np.diff(rep) >= 0) and rep.max() < 100.0
    # rate scale 4 over a duration longer than the trace: time compressed and the trace tiled
    fast = tenant_arrivals(TenantPlan("a", tr, tr.rate_rps, 0.0, 10_000), 4.0, 60.0, rng)[0]
    assert fast.size == pytest.approx(tr.rate_rps * 4 * 60, rel=0.03)
    assert fast.max() < 60.0 and fast.min() >= 0


def test_cap_lengths_respects_context_and_global_caps():
    inp, out = cap_lengths(np.array([5000, 10, 1, 300]), np.array([100, 5000, 0, 70]), 4096, 256, 64)
    assert out.tolist() == [64, 64, 1, 64]
    assert inp.tolist() == [256, 10, 2, 256]
    inp, out = cap_lengths(np.array([4000, 100]), np.array([500, 5000]), 4096)
    assert (inp + out <= 4096).all() and out.tolist() == [500, 4094] and inp.tolist() == [3596, 2]


def test_build_requests_ids_order_and_determinism():
    tr = poisson_trace(5.0, 50.0)
    plans = [TenantPlan("a", tr, 3.0, 0.0, 2048), TenantPlan("b", tr, 1.0, 7.0, 2048)]
    reqs = build_requests(plans, 1.0, 30.0, seed=4)
    assert reqs == build_requests(plans, 1.0, 30.0, seed=4)
    assert reqs != build_requests(plans, 1.0, 30.0, seed=5)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times)
    for name in ("a", "b"):
        mine = [r for r in reqs if r.tenant == name]
        assert [r.request_id for r in mine] == [f"{name}-{i}" for i in range(len(mine))]
    assert len({r.request_id for r in reqs}) == len(reqs)
    with pytest.raises(ValueError):
        build_requests(plans, 0.0, 30.0, seed=4)


def _bursty_trace(span: float = 200.0):
    """Arrivals only in [0, 20) of each 100 s: one burst per period."""
    t = np.concatenate([np.linspace(0, 19.9, 200) + k * 100 for k in range(int(span // 100))])
    n = t.size
    return make_trace("b", "<memory>", t, np.full(n, 50), np.full(n, 10), period_s=span)


def test_superpose_adds_independent_copies_and_keeps_burst_length():
    """Scale s as more users: ⌈s⌉ copies at independent offsets, the last thinned; bursts keep their length
    (compress makes them s times shorter and s times denser)."""
    from loadgen.mix import superposed_arrivals
    tr = _bursty_trace()
    plan = TenantPlan("a", tr, tr.rate_rps, 0.0, 10_000)
    base = superposed_arrivals(plan, 1.0, 200.0, seed=5, index=0)[0]
    assert base.size == 400
    s3 = superposed_arrivals(plan, 3.0, 200.0, seed=5, index=0)[0]
    assert s3.size == 1200 and np.all(np.diff(s3) >= 0)
    assert np.isin(base, s3).all()  # the first copy is the tenant's own arrivals
    s25 = superposed_arrivals(plan, 2.5, 200.0, seed=5, index=0)[0]
    assert s25.size == pytest.approx(1000, rel=0.06)
    # within any 1-s window the densest second holds at most s copies' worth (bursts overlap, not compress)
    per_s = np.bincount(s3.astype(int), minlength=200)
    assert per_s.max() <= 3 * 11
    comp = tenant_arrivals(plan, 3.0, 200.0, np.random.default_rng(0))[0]
    assert np.bincount(comp.astype(int), minlength=200).max() >= 25  # compressed: 3x denser bursts
    again = superposed_arrivals(plan, 3.0, 200.0, seed=5, index=0)[0]
    assert np.array_equal(again, s3)  # deterministic for a seed
    other = superposed_arrivals(plan, 3.0, 200.0, seed=6, index=0)[0]
    assert not np.array_equal(other, s3)


def test_build_requests_scale_modes():
    tr = poisson_trace(5.0, 100.0)
    plans = [TenantPlan("a", tr, 5.0, 0.0, 10_000), TenantPlan("b", tr, 2.0, 30.0, 10_000)]
    sup = build_requests(plans, 2.0, 100.0, 1, "superpose")
    comp = build_requests(plans, 2.0, 100.0, 1, "compress")
    assert len(sup) == pytest.approx(len(comp), rel=0.1)
    assert len(sup) == pytest.approx(2 * len(build_requests(plans, 1.0, 100.0, 1)), rel=0.05)
    assert build_requests(plans, 1.0, 100.0, 1, "superpose") == build_requests(plans, 1.0, 100.0, 1, "compress")
    with pytest.raises(ValueError, match="scale_mode"):
        build_requests(plans, 2.0, 100.0, 1, "stretch")
