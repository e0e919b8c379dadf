"""What-if: fast enough for the scheduler, and its predictions move the right way."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.policies.actions import GrantLease
from shared.sim.synthetic import synthetic_snapshot
from shared.sim.whatif import WhatIf


@pytest.fixture(scope="module")
def snap():
    cluster = load_cluster(REPO_CONFIGS / "cluster-h100x32.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-16mix.yaml", cluster)
    s = synthetic_snapshot(cluster, tenants, random.Random(5), load=0.5)
    hot = s.devices[tenants.get("t00").home_devices[0]]  # the tenant that seeks leases has a prompt backlog
    hot.queued, hot.queued_prefill_tokens, hot.running, hot.oldest_pending_s = 8, 12000, 32, s.now - 0.05
    hot.decode_kv_tokens = 32 * 1200
    return cluster, s


def _cands(snap, n=8, share=0.4, mode="segments"):
    busy = next(d for d in snap.devices.values() if d.queued_prefill_tokens > 0 and d.home_tenant == "t00")
    guests = [d for d in snap.devices.values() if d.home_tenant != "t00"][:n]
    segs = ("*",) if mode == "sequences" else tuple(f"mlp[{i}]" for i in range(16))
    return [GrantLease("t00", busy.id, g.id, segs, 2.0, share, 0, mode=mode) for g in guests]


def test_whatif_latency_eight_candidates_on_32_devices(snap):
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    cands = _cands(s, 8) + _cands(s, 0)
    w.evaluate(s, cands)  # warm the cost caches
    times = []
    for i in range(200):
        c = _cands(s, 8, share=0.2 + (i % 5) / 10, mode="sequences" if i % 2 else "segments")
        t0 = time.thread_time()  # CPU time of this thread: what the what-if costs, not the machine's load
        res = w.evaluate(s, c)
        times.append(time.thread_time() - t0)
        assert len(res) == 8
    times.sort()
    p99 = times[int(0.99 * len(times)) - 1]
    assert p99 < 0.010  # the published target is 5 ms wall (docs/simulator.md); CPU time has margin for CI


def test_offload_to_idle_guest_helps_a_prefill_backlog(snap):
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    idle = [d for d in s.devices.values() if d.home_tenant != "t00"]
    idle[0].busy, idle[0].running, idle[0].queued, idle[0].queued_prefill_tokens = False, 0, 0, 0
    busy = next(d for d in s.devices.values() if d.queued_prefill_tokens > 0 and d.home_tenant == "t00")
    c = GrantLease("t00", busy.id, idle[0].id, tuple(f"mlp[{i}]" for i in range(20)), 2.0, 0.5, 0)
    r = w.evaluate(s, [c])[0]
    assert r.leased_iter_s < r.home_iter_s and r.gain > 0.1
    assert r.ttft_s < r.ttft_before_s
    assert r.guest_memory_peak_bytes > idle[0].used_bytes
    assert set(r.busy_timeline) == {busy.id, idle[0].id}


def test_more_share_costs_the_guest_more(snap):
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    lo, hi = w.evaluate(s, [_cands(s, 1, share=0.1)[0], _cands(s, 1, share=0.8)[0]])
    assert hi.guest_tpot_s > lo.guest_tpot_s and hi.guest_ttft_s > lo.guest_ttft_s
    assert "guest_tpot" in hi.breaks or "guest_ttft" in hi.breaks


def test_memory_bound_is_checked(snap):
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    c = _cands(s, 1, mode="sequences")[0]
    g = s.devices[c.guest_device]
    saved = g.used_bytes
    g.used_bytes = g.limit_bytes - 10**9  # 1 GB left: a 7B model does not fit
    try:
        r = w.evaluate(s, [c])[0]
    finally:
        g.used_bytes = saved
    assert "memory_now" in r.breaks and not r.ok


def test_a_lane_on_a_decoding_guest_waits_for_the_guests_own_iteration(snap):
    """While the guest's own tenant decodes, a lane runs at most one iteration between two of its own, so a lane
    token costs one of the guest's iterations too, however large the share: a guest with a long own iteration is
    no place for a lane (its TPOT would break), one with a short own iteration is."""
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    c = _cands(s, 1, share=0.9, mode="sequences")[0]
    g = s.devices[c.guest_device]
    saved = (g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens)
    try:
        g.busy, g.queued, g.queued_prefill_tokens = True, 0, 0
        g.running, g.decode_kv_tokens = 4, 4 * 500  # a short own decode iteration
        light = w.evaluate(s, [c])[0]
        g.running, g.decode_kv_tokens = 256, 256 * 3000  # a long one
        heavy = w.evaluate(s, [c])[0]
    finally:
        g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens = saved
    assert "lease_tpot" not in light.breaks
    assert "lease_tpot" in heavy.breaks and heavy.tpot_s > light.tpot_s


def test_a_lane_on_a_guest_idle_between_requests_is_priced_as_if_its_tenant_were_back(snap):
    """A guest whose own tenant is idle at this instant but had arrivals in the last 30 s will be decoding (and
    prefilling, which stops the lane) within the lane's life: its lane is priced slower than on a guest whose
    tenant is gone, and slower still the more of the device its tenant's prompts take."""
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    c = _cands(s, 1, share=0.9, mode="sequences")[0]
    g = s.devices[c.guest_device]
    gt = s.tenants[g.home_tenant]
    ten = s.tenants["t00"]
    saved = (g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens, gt.rate_rps, gt.mean_input)
    try:
        g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens = False, 0, 0, 0, 0
        gt.rate_rps = 0.0
        gone = w.lane_tpot(s, ten, g, c.share)
        gt.rate_rps, gt.mean_input = 1.0, 500
        back = w.lane_tpot(s, ten, g, c.share)
        gt.rate_rps, gt.mean_input = 8.0, 4000
        prompts = w.lane_tpot(s, ten, g, c.share)
    finally:
        g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens, gt.rate_rps, gt.mean_input = saved
    assert gone < back < prompts
    assert w.lane_tpot(s, ten, g, c.share, batch=64) > w.lane_tpot(s, ten, g, c.share, batch=1)


def test_a_hand_off_lane_is_priced_by_the_homes_tpot_while_the_home_can_take_its_sequences_back(snap):
    """With the lane hand-off a lane only prefills and its sequences decode in the home's batch, so a guest whose
    own long iterations would break a decoding lane's TPOT does not break a hand-off lane's: its predicted TPOT is
    the home's iteration. When the home lacks the memory to take the sequences back, they would decode on the
    guest, and the lane's own TPOT decides again."""
    cluster, s = snap
    w = WhatIf.for_cluster(cluster)
    c = _cands(s, 1, share=0.9, mode="sequences")[0]
    hb = dataclasses.replace(c, handback=True)
    g, home = s.devices[c.guest_device], s.devices[c.home_device]
    saved = (g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens, home.used_bytes)
    try:
        g.busy, g.queued, g.queued_prefill_tokens = True, 0, 0
        g.running, g.decode_kv_tokens = 256, 256 * 3000  # a long own iteration: a decoding lane would be too slow
        plain, handed = w.evaluate(s, [c, hb])
        home.used_bytes = home.limit_bytes  # no room at home: the hand-off is refused, the lane decodes
        full = w.evaluate(s, [hb])[0]
    finally:
        g.busy, g.running, g.queued, g.queued_prefill_tokens, g.decode_kv_tokens, home.used_bytes = saved
    assert "lease_tpot" in plain.breaks
    assert "lease_tpot" not in handed.breaks and handed.tpot_s == pytest.approx(handed.home_iter_s)
    assert "lease_tpot" in full.breaks and full.tpot_s == pytest.approx(plain.tpot_s)
