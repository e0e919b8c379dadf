"""Leases inside the simulator: staging over the link, guest lanes, offloaded segments, drain, cached weights."""
from __future__ import annotations

import random

import pytest

from shared.policies.actions import GrantLease, Placement, Trigger
from shared.policies.base import Policy
from shared.sim import SimConfig, Simulator
from shared.sim.synthetic import small_cluster, small_tenants
from shared.workload import Workload, WorkloadRequest


class _OneLease(Policy):
    """t0 at home on d0, t1 on d1; at the first tick t0 leases d1 (``mode``); t0's requests go to the lane."""

    registry_name = "test-one-lease"

    def __init__(self, mode: str, duration_s: float = 1.0) -> None:
        super().__init__()
        self.mode, self.duration_s, self.tick_s, self.granted = mode, duration_s, 0.05, False

    def initial_placement(self, snapshot, offered):
        return Placement({"d0": ("t0",), "d1": ("t1",)})

    def route(self, tenant, input_tokens, output_tokens, snapshot):
        if tenant == "t0" and snapshot.devices["d1"].guest_engines.get("t0", (0, 0, False))[2]:
            return "d1"
        return "d0" if tenant == "t0" else "d1"

    def decide(self, trigger: Trigger, snapshot, whatif=None):
        if trigger.kind != "tick" or self.granted:
            return []
        self.granted = True
        segs = ("*",) if self.mode == "sequences" else tuple(f"mlp[{i}]" for i in range(32))
        return [GrantLease("t0", "d0", "d1", segs, self.duration_s, 0.5, 0, mode=self.mode)]


def _run(mode, reqs, duration_s=1.0):
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    w = Workload("leases", tuple(reqs), t, duration_s=5.0, seed=0)
    sim = Simulator(c, t, _OneLease(mode, duration_s), SimConfig(), random.Random(0))
    return sim, sim.run(w)


def test_sequences_lease_stages_runs_on_the_guest_and_drains():
    reqs = [WorkloadRequest(f"a{i}", 0.2 + 0.01 * i, "t0", 1000, 50) for i in range(6)]
    sim, r = _run("sequences", reqs)
    assert r.leases["granted"] == 1 and r.leases["ended"] == 1
    lease = sim.leases.finished[0]
    wb = lease.engine.cost.weight_bytes
    assert lease.staged_new_bytes == wb
    # staged over NVLink: active after latency + bytes / bandwidth
    nv = sim.devices["d0"].profile.link("nvlink")
    assert lease.active_from - lease.start == pytest.approx(nv.latency_s + wb / nv.bandwidth)
    on_guest = [q for q in sim.requests if q.engine.device.parent is not None]
    assert on_guest and all(q.status == 2 for q in sim.requests)
    d1 = sim.devices["d1"]
    assert ("t0", "*") in d1.mem.staged and d1.mem.staged[("t0", "*")].pins == 0  # cached after the lease
    assert not d1.lanes and not d1.hosted
    assert max(b for _, b in d1.mem.timeline) <= d1.mem.limit
    assert r.devices["d1"]["guest_utilization"] > 0


def test_segments_lease_offloads_prefill_iterations():
    reqs = [WorkloadRequest(f"a{i}", 0.2 + 0.002 * i, "t0", 2000, 5) for i in range(12)]
    sim, r = _run("segments", reqs)
    _, base = _run("segments", [])  # no work: nothing offloaded
    assert r.leases["offloaded_iterations"] > 0 and base.leases["offloaded_iterations"] == 0
    assert r.leases["activation_bytes_moved"] > 0
    lease = sim.leases.finished[0]
    assert lease.guest_busy_s > 0
    # the same requests without the lease take longer to get their first tokens
    class _NoLease(_OneLease):
        def decide(self, trigger, snapshot, whatif=None):
            return []
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    alone = Simulator(c, t, _NoLease("segments"), SimConfig(), random.Random(0))
    alone.run(Workload("x", tuple(reqs), t, 5.0, 0))
    assert max(q.first_token for q in sim.requests) < max(q.first_token for q in alone.requests)


def test_guest_tenant_comes_first():
    """While the guest's own tenant prefills, the lane gets (almost) nothing: its request is not delayed by
    more than one lane step beyond running alone."""
    lane_work = [WorkloadRequest(f"a{i}", 0.2 + 0.001 * i, "t0", 2000, 200) for i in range(8)]
    own = [WorkloadRequest("b", 0.5, "t1", 1500, 20)]
    sim, _ = _run("sequences", lane_work + own, duration_s=3.0)
    b = next(q for q in sim.requests if q.rid == "b")
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    solo = Simulator(c, t, _OneLease("sequences"), SimConfig(), random.Random(0))
    solo.policy.granted = True  # no lease
    solo.run(Workload("solo", tuple(own), t, 5.0, 0))
    b0 = solo.requests[0]
    assert b.first_token - b.arrival < (b0.first_token - b0.arrival) + 0.06
    assert b.first_token - b.arrival < t.get("t1").sla.ttft_ms / 1000
