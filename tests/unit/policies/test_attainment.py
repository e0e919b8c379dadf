"""A tenant's recent SLA attainment (``shared/policies/attainment.py``), as the simulator and the live scheduler
measure it, and what ``slice`` does with it: a device whose tenant is further behind its SLA than the borrower
lends it nothing new."""
from __future__ import annotations

import math
import random

import pytest

from shared.policies import make_policy
from shared.policies.actions import Trigger
from shared.policies.attainment import Attainment, missed
from shared.sim import SimConfig, Simulator
from shared.sim.synthetic import bursty_workload, small_cluster, small_tenants


def test_missed_is_ttft_or_tpot_past_its_target():
    assert not missed(0.1, 0.02, (0.2, 0.03))
    assert missed(0.21, 0.02, (0.2, 0.03))
    assert missed(0.1, 0.031, (0.2, 0.03))
    assert not missed(0.1, None, (0.2, 0.03))  # one output token: no TPOT to miss


def test_rate_is_the_share_missed_and_old_requests_fade():
    a = Attainment(tau_s=100.0)
    assert a.rate == 0.0 and a.requests == 0.0
    for i in range(10):
        a.observe(float(i), i < 3)
    assert a.rate == pytest.approx(0.3, abs=0.02)  # the three misses came first, so they already faded a little
    for i in range(10):
        a.observe(1000.0 + i, False)  # ten clean requests 10 time constants later
    assert a.rate < 0.001
    assert a.requests == pytest.approx(sum(math.exp(-(9 - i) / 100) for i in range(10)), rel=0.01)


def test_an_out_of_order_end_counts_without_decaying_backwards():
    a = Attainment(tau_s=100.0)
    a.observe(50.0, False)
    a.observe(40.0, True)  # ended earlier than the last one seen (events from two workers)
    assert a.requests == pytest.approx(2.0) and a.rate == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tau_s"):
        Attainment(tau_s=0)


def test_the_simulator_keeps_each_tenants_recent_violation_rate_in_the_snapshot():
    c = small_cluster(6, 3)
    t = small_tenants(c, ["llama-7b", "llama-7b", "llama-7b", "llama-13b"])
    names = [x.name for x in t.tenants]
    w = bursty_workload(t, [40.0, 0.5, 0.5, 0.5], 30.0, random.Random(3), burst_factor=10.0, mean_input=2000,
                        mean_output=40)
    sim = Simulator(c, t, make_policy("container"), SimConfig(), random.Random(0))
    res = sim.run(w).to_dict()
    hot = sim.snapshot.tenants[names[0]]
    assert hot.recent_requests > 50
    assert res["tenants"][names[0]]["violation_rate"] > 0.05  # the overloaded tenant misses its SLA ...
    assert hot.violation_rate > 0.05  # ... and its recent rate says so (decayed, so not equal to the whole run's)


def _guard_case():
    from shared.config import SLA
    from shared.model.config import PRESETS
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, LeaseTable, TenantState
    sla = SLA(ttft_ms=200, tpot_ms=30)
    tenants = {n: TenantState(n, PRESETS["llama-7b"], sla, [h], mean_input=1000, mean_output=100)
               for n, h in (("a", "h"), ("b", "g"))}
    home = DeviceState("h", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="a", tenants=["a"], busy=True,
                       running=64, queued=30, queued_prefill_tokens=40_000, decode_kv_tokens=64 * 1000)
    guest = DeviceState("g", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="b", tenants=["b", "a"],
                        guest_share=0.6, guest_engines={"a": (2, 0, True)})
    lease = LeaseState("L", "a", "h", "g", ("*",), 0.0, 1.05, 0, 0.6, mode="sequences", state="active")
    return tenants, ClusterSnapshot(now=1.0, devices={"h": home, "g": guest}, tenants=tenants,
                                    leases=LeaseTable({"L": lease}))


@pytest.mark.parametrize("lender,borrower,requests,guarded", [
    (0.02, 0.0, 100, False),  # within guard_rate (0.05)
    (0.08, 0.0, 100, True),
    (0.08, 0.0, 20, False),  # too few recent requests to judge (guard_min_requests 50)
    (0.08, 0.07, 100, False),  # the borrower is about as far behind (within guard_ratio 1.2)
    (0.10, 0.07, 100, True),
])
def test_slice_guards_a_lender_further_behind_its_sla_than_the_borrower(lender, borrower, requests, guarded):
    pol = make_policy("slice", {"segments": False})
    tenants, snap = _guard_case()
    tenants["b"].violation_rate, tenants["b"].recent_requests = lender, requests
    tenants["a"].violation_rate, tenants["a"].recent_requests = borrower, 500
    assert pol._guarded(snap.devices["g"], tenants["a"], snap) is guarded
    off = make_policy("slice", {"segments": False, "guard_rate": 0})
    assert not off._guarded(snap.devices["g"], tenants["a"], snap)


def test_slice_routes_no_new_prompt_to_a_lane_on_a_guarded_lender():
    from shared.sim.whatif import WhatIf
    pol = make_policy("slice", {"segments": False})
    pol.devices_of = {"a": ["h"], "b": ["g"]}
    tenants, snap = _guard_case()
    whatif = WhatIf()
    pol.decide(Trigger("tick"), snap, whatif)
    assert "L" not in pol._closed and pol.route("a", 1000, 100, snap) == "g"  # the lane is the faster way
    tenants["b"].violation_rate, tenants["b"].recent_requests = 0.2, 100  # the lender's own tenant falls behind
    pol.decide(Trigger("tick"), snap, whatif)
    assert "L" in pol._closed and pol.route("a", 1000, 100, snap) == "h"
    tenants["a"].violation_rate, tenants["a"].recent_requests = 0.2, 100  # ... and so does the borrower
    pol.decide(Trigger("tick"), snap, whatif)
    assert "L" not in pol._closed and pol.route("a", 1000, 100, snap) == "g"
