"""``pooled-bound``, the analytic ceiling: sound (no policy has fewer violations or more throughput, on a grid of
workloads and scales) and not trivial (it does bind when the cluster is overloaded)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from services.cli.simulate import simulate
from shared.policies import POLICIES
from shared.sim.ceiling import MinWork, request_arrays, violations_lower_bound
from shared.sim.synthetic import bursty_workload, small_cluster, small_tenants
from shared.costmodel import cost_for
from shared.model.config import PRESETS

POLICIES_RUN = [n for n in POLICIES.names() if not getattr(POLICIES.get(n), "analytic", False)]


def test_min_work_never_exceeds_the_cost_models_own_time():
    """A request alone, or in any batch, takes at least its min work: check against the isolated run and against
    a full batch's per-request share."""
    for preset in ("llama-7b", "llama-13b"):
        cost = cost_for(PRESETS[preset], "h100-80gb")
        mw = MinWork(PRESETS[preset], "h100-80gb")
        for inp, out in ((10, 1), (200, 50), (1800, 27), (1036, 201), (3000, 900)):
            ttft, tpot = cost.isolated_latency(inp, out)
            alone = ttft + (out - 1) * tpot
            assert 0 < mw(np.array([inp]), np.array([out]))[0] <= alone
        # 256 decoding sequences of context 1000: one iteration's time covers their 256 tokens' min work
        it = cost.iteration_time(256, 256 * 1000)
        per_token = mw(np.array([1000]), np.array([2]))[0] - mw(np.array([1000]), np.array([1]))[0]
        assert 256 * per_token <= it


def test_lower_bound_counts_what_cannot_fit():
    arr = np.array([0.0, 0.1, 0.2, 0.3])
    dead = arr + 0.5
    work = np.array([0.5, 0.3, 0.2, 0.1])
    # one device, window 1 s: 1 device-second holds the three cheapest (0.6), not the fourth too (1.1)
    assert violations_lower_bound(arr, dead, work, devices=1, windows=(1.0,)) == 1
    assert violations_lower_bound(arr, dead, work, devices=2, windows=(1.0,)) == 0
    assert violations_lower_bound(arr, dead + 5.0, work, devices=1, windows=(1.0,)) == 0  # due later: not counted


@pytest.mark.parametrize("seed,rates", [(1, (6.0, 1.5, 1.0)), (3, (10.0, 0.5, 0.2))])
def test_no_policy_beats_the_ceiling(seed, rates):
    """On a grid of small workloads and scales every policy has at least the bound's violations and at most its
    throughput; at the largest scale the bound binds (it is not trivially zero there)."""
    c = small_cluster(4, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b", "llama-13b"])
    bound_bites = False
    for scale in (2.0, 16.0):
        w = bursty_workload(t, [r * scale for r in rates], 30.0, random.Random(seed), mean_input=1500)
        w = dataclasses.replace(w, rate_scale=scale)
        ceil = simulate(c, w, "pooled-bound")
        bound_bites |= ceil["violation_rate"] > 0
        for name in POLICIES_RUN:
            r = simulate(c, w, name)
            assert r["violation_rate"] >= ceil["violation_rate"] - 1e-12, (name, scale)
            assert r["tokens_per_s"] <= ceil["tokens_per_s"] + 1e-9, (name, scale)
    assert bound_bites


def test_request_arrays_price_per_request_deadlines():
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-13b"])
    w = bursty_workload(t, [3.0, 1.0], 20.0, random.Random(5))
    arr, dead, work, ten = request_arrays(w, c)
    assert len(arr) == len(w.requests) and (dead > arr).all() and (work > 0).all()
    assert set(ten.tolist()) == {0, 1}
