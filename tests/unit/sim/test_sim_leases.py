"""Leases inside the simulator: staging over the link, guest lanes, offloaded segments, drain, cached weights."""
from __future__ import annotations

import dataclasses
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

    def __init__(self, mode: str, duration_s: float = 1.0, handback: bool = False) -> None:
        super().__init__()
        self.mode, self.duration_s, self.tick_s, self.granted = mode, duration_s, 0.05, False
        self.handback = handback

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
        return [GrantLease("t0", "d0", "d1", segs, self.duration_s, 0.5, 0, mode=self.mode, handback=self.handback)]


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
    # the cluster's busy time counts the guest's lane work, as the anatomy's busy bins do; the utilisation only each
    # device's own steps
    own = sum(v["utilization"] for v in r.devices.values()) / len(r.devices)
    assert r.total["device_utilization_mean"] == pytest.approx(own) and own < r.total["device_busy_mean"]
    assert r.devices["d1"]["work_s"] == pytest.approx(sim.devices["d1"].busy_s + sim.devices["d1"].guest_busy_s)
    work = sum(v["work_s"] for v in r.devices.values())
    assert r.total["device_busy_mean"] == pytest.approx(work / (max(r.end_s, r.window_s) * len(r.devices)))
    assert r.total["device_s_per_1k_tokens"] == pytest.approx(work / r.total["output_tokens"] * 1e3)
    # the lane's guest time is the lease's, counted per tenant; a lease with no segments offloads nothing
    assert r.leases["lane_busy_s"] == pytest.approx(sim.devices["d1"].guest_busy_s) and r.leases["guest_busy_s"] == 0
    assert r.leases["by_tenant"] == {"t0": {"granted": 1, "guest_busy_s": 0.0, "lane_busy_s": r.leases["lane_busy_s"]}}


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


def _run_lanes(lanes: str, reqs, duration_s=3.0):
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    sim = Simulator(c, t, _OneLease("sequences", duration_s), SimConfig(guest_lanes=lanes), random.Random(0))
    steps: list[tuple[float, float, bool]] = []  # (start, end, on a lane) of every step on d1
    orig = sim._on_step

    def on_step(dev):
        if dev.id == "d1":
            steps.append((dev.cur_start, sim.now, dev.parent is not None))
        orig(dev)
    sim._on_step = on_step
    return sim, sim.run(Workload("lanes", tuple(reqs), t, 5.0, 0)), steps


def _mixed_load():
    own = [WorkloadRequest(f"b{i}", 0.05 + 0.01 * i, "t1", 200, 300) for i in range(8)]  # d1's tenant decodes
    lane = [WorkloadRequest(f"a{i}", 0.4 + 0.05 * i, "t0", 1500, 20) for i in range(6)]  # prompts for the lane
    return own + lane


def test_exclusive_lanes_take_whole_iterations_in_turn():
    """A lane's iteration and the device's own never overlap, and a lane iteration runs at full speed."""
    sim, _, steps = _run_lanes("exclusive", _mixed_load())
    lane_steps = [s for s in steps if s[2]]
    own_steps = [s for s in steps if not s[2]]
    assert lane_steps and own_steps
    for a0, a1, _ in lane_steps:
        for b0, b1, _ in own_steps:
            assert a1 <= b0 + 1e-12 or b1 <= a0 + 1e-12, "a lane step overlapped an own step"
    assert all(q.status == 2 for q in sim.requests)


def test_exclusive_lanes_serve_prompts_sooner_than_fluid_sharing():
    """Same share of the guest over time, but a prompt on the lane runs at full speed in turn instead of beside
    the own tenant at a fraction of it; the own tenant stays inside its SLA either way."""
    out = {}
    for lanes in ("fluid", "exclusive"):
        sim, r, _ = _run_lanes(lanes, _mixed_load())
        on_lane = [q for q in sim.requests if q.rid.startswith("a") and q.engine.device.parent is not None]
        assert on_lane
        out[lanes] = (max(q.first_token - q.arrival for q in on_lane), r.tenants["t1"])
    assert out["exclusive"][0] < out["fluid"][0]
    for _, t1 in out.values():
        assert t1["violation_rate"] == 0.0


def test_unknown_lane_model_is_refused():
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    with pytest.raises(ValueError, match="guest_lanes"):
        Simulator(c, t, _OneLease("sequences"), SimConfig(guest_lanes="shared"), random.Random(0))


def test_exclusive_lanes_never_run_twice_in_a_row_while_the_own_tenant_decodes():
    """Between two of the own tenant's iterations at most one lane iteration runs, so its tokens keep coming."""
    sim, _, steps = _run_lanes("exclusive", _mixed_load())
    steps.sort()
    own = [s for s in steps if not s[2]]
    first, last = own[0][0], own[-1][1]
    lane_runs = [(a, b) for a, b in zip(steps, steps[1:]) if a[2] and b[2] and first <= a[0] and b[1] <= last]
    assert sum(s[2] for s in steps) >= 3
    assert not lane_runs, f"{len(lane_runs)} lane iterations followed another while the own tenant decoded"


class _LeaseFullHome(_OneLease):
    """As :class:`_OneLease`, but when it grants the lease the home's memory is all taken but for less than one
    request's KV."""

    sim: Simulator

    def decide(self, trigger: Trigger, snapshot, whatif=None):
        if trigger.kind == "tick" and not self.granted:
            mem = self.sim.devices["d0"].mem
            assert mem.try_alloc("kv", mem.limit - mem.used - 1024, self.sim.now)
        return super().decide(trigger, snapshot, whatif)


class _LeaseHomeFullOfCachedWeights(_OneLease):
    """As :class:`_LeaseFullHome`, but what fills the home is another tenant's staged weights that no lease pins
    (cached after its lease ended)."""

    sim: Simulator

    def decide(self, trigger: Trigger, snapshot, whatif=None):
        if trigger.kind == "tick" and not self.granted:
            mem = self.sim.devices["d0"].mem
            assert mem.stage("t9", "*", mem.limit - mem.used - 1024, self.sim.now)
            mem.unpin("t9", "*", self.sim.now)
        return super().decide(trigger, snapshot, whatif)


def _run_handback(handback: bool, block_home_kv: bool = False, cached_home: bool = False):
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    cls = _LeaseFullHome if block_home_kv else _LeaseHomeFullOfCachedWeights if cached_home else _OneLease
    policy = cls("sequences", 3.0, handback)
    sim = policy.sim = Simulator(c, t, policy, SimConfig(), random.Random(0))
    return sim, sim.run(Workload("handback", tuple(_mixed_load()), t, 5.0, 0))


def test_lane_handback_decodes_prefilled_sequences_at_home():
    """Prefill-only lanes: the guest prefills the tenant's prompts, the home decodes them in its own batch, so the
    guest spends less time on the lane and every token still gets generated."""
    sim0, r0 = _run_handback(False)
    sim1, r1 = _run_handback(True)
    moved = [q for q in sim1.requests if q.rid.startswith("a") and q.engine.device.id == "d0"]
    assert r1.leases["handed_back"] == len(moved) > 0
    assert all(q.status == 2 and q.generated == q.output for q in sim1.requests)
    assert r1.tenants["t0"]["output_tokens"] == r0.tenants["t0"]["output_tokens"]
    assert sim1.devices["d1"].guest_busy_s < sim0.devices["d1"].guest_busy_s
    for dev in sim1.devices.values():  # the KV moved with the sequence: freed on the guest, released at home
        assert dev.mem.by_kind["kv"] == 0
        assert max(b for _, b in dev.mem.timeline) <= dev.mem.limit
    assert "handed_back" not in r0.leases


class _LeaseFullHomeOfTwo(_LeaseFullHome):
    """As :class:`_LeaseFullHome`, with a second device of t0's container (d2) that has room."""

    def initial_placement(self, snapshot, offered):
        return Placement({"d0": ("t0",), "d1": ("t1",), "d2": ("t0",)})


def test_lane_handback_goes_to_another_device_of_the_container_when_the_home_is_full():
    """The lease's home (d0) has no room for the KV: the sequence goes to d2, the other device of t0's container,
    decodes there, and its KV is released there when it finishes."""
    c = small_cluster(3, 3)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    t = dataclasses.replace(t, tenants=(dataclasses.replace(t.tenants[0], home_devices=("d0", "d2")), t.tenants[1]))
    policy = _LeaseFullHomeOfTwo("sequences", 3.0, True)
    sim = policy.sim = Simulator(c, t, policy, SimConfig(), random.Random(0))
    r = sim.run(Workload("handback", tuple(_mixed_load()), t, 5.0, 0))
    laned = [q for q in sim.requests if q.rid.startswith("a")]
    assert laned and all(q.engine.device.id == "d2" for q in laned)
    assert r.leases["handed_back"] == len(laned)
    assert all(q.status == 2 and q.generated == q.output for q in sim.requests)
    for did in ("d1", "d2"):  # every KV moved or released (d0 still holds what filled it)
        assert sim.devices[did].mem.by_kind["kv"] == 0


class _LeaseOfTwoHomes(_OneLease):
    """As :class:`_OneLease`, with a second device of t0's container (d2)."""

    def initial_placement(self, snapshot, offered):
        return Placement({"d0": ("t0",), "d1": ("t1",), "d2": ("t0",)})


def _run_two_homes(tpot_target_s: float):
    """t0's lease home d0 decodes 30 sequences of its own while its lane on d1 prefills six prompts; d2, the
    other device of t0's container, is idle. Every request's TPOT target is ``tpot_target_s``."""
    c = small_cluster(3, 3)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    t = dataclasses.replace(t, tenants=(dataclasses.replace(t.tenants[0], home_devices=("d0", "d2")), t.tenants[1]))
    own = [WorkloadRequest(f"h{i}", 0.001 * i, "t0", 200, 400) for i in range(30)]
    lane = [WorkloadRequest(f"a{i}", 0.4 + 0.05 * i, "t0", 1500, 20) for i in range(6)]
    sim = Simulator(c, t, _LeaseOfTwoHomes("sequences", 3.0, True), SimConfig(), random.Random(0))
    sim.tpot_target = lambda r: tpot_target_s
    return sim, sim.run(Workload("handback", tuple(own + lane), t, 5.0, 0))


def test_lane_handback_fills_another_device_of_the_container_when_the_homes_step_would_pass_the_target():
    """The lease's home takes a handed-back sequence while its predicted step with it stays within
    HANDBACK_FILL × the sequence's TPOT target; past that, a device of the container within it does."""
    from shared.costmodel import cost_for
    from shared.handback import HANDBACK_FILL, step_with
    cost = cost_for(small_tenants(small_cluster(3, 3), ["llama-7b"]).tenants[0].model.config, "h100-80gb")
    idle, loaded = step_with(cost, 0, 0, 1500), step_with(cost, 30, 30 * 200, 1500)
    assert loaded > 1.05 * idle
    sim, r = _run_two_homes((idle + loaded) / 2 / HANDBACK_FILL)  # d2 is within the bound, d0 is past it
    laned = [q for q in sim.requests if q.rid.startswith("a")]
    assert r.leases["handed_back"] == len(laned) == 6
    assert all(q.engine.device.id == "d2" for q in laned)
    assert all(q.status == 2 and q.generated == q.output for q in sim.requests)
    sim, r = _run_two_homes(10 * loaded)  # the home stays within the bound: it keeps them
    assert all(q.engine.device.id == "d0" for q in sim.requests if q.rid.startswith("a"))
    sim, r = _run_two_homes(idle / 2)  # no device within it: the lease's home, as before the rule
    assert all(q.engine.device.id == "d0" for q in sim.requests if q.rid.startswith("a"))


def test_lane_handback_keeps_the_sequence_when_its_kv_does_not_fit_at_home():
    sim, r = _run_handback(True, block_home_kv=True)
    on_lane = [q for q in sim.requests if q.rid.startswith("a")]
    assert on_lane and all(q.engine.device.parent is not None for q in on_lane)
    assert "handed_back" not in r.leases
    assert all(q.status == 2 and q.generated == q.output for q in sim.requests)


def test_lane_handback_evicts_cached_weights_at_a_full_home():
    """Cached staged weights (no lease pins them) are reclaimable memory: the hand-back evicts them to fit the KV,
    as admission does and as the worker's hand-off does in the GMG; a KV reservation is never evicted (above)."""
    sim, r = _run_handback(True, cached_home=True)
    moved = [q for q in sim.requests if q.rid.startswith("a")]
    assert moved and all(q.engine.device.id == "d0" for q in moved)
    assert r.leases["handed_back"] == len(moved)
    assert ("t9", "*") not in sim.devices["d0"].mem.staged


class _OneWideLease(_OneLease):
    """As :class:`_OneLease` with a "segments" lease of ``share`` of d1."""

    def __init__(self, share: float) -> None:
        super().__init__("segments", 3.0)
        self.share = share

    def decide(self, trigger: Trigger, snapshot, whatif=None):
        if trigger.kind != "tick" or self.granted:
            return []
        self.granted = True
        return [GrantLease("t0", "d0", "d1", tuple(f"mlp[{i}]" for i in range(32)), 3.0, self.share, 0,
                           mode="segments")]


def _run_segments(own: list[WorkloadRequest], share: float = 0.8):
    """t0 prefills eight prompts from 0.2 s, offloading its MLP segments to d1 under a lease of ``share``; t1's
    ``own`` requests run on d1."""
    borrower = [WorkloadRequest(f"a{i}", 0.2 + 0.01 * i, "t0", 500, 300) for i in range(8)]
    c = small_cluster(2, 2)
    t = small_tenants(c, ["llama-7b", "llama-7b"])
    sim = Simulator(c, t, _OneWideLease(share), SimConfig(), random.Random(0))
    sim.record_busy(0.25)
    r = sim.run(Workload("segments", tuple(sorted(borrower + own, key=lambda q: q.arrival_s)), t, 5.0, 0))
    return sim, r


def test_segments_run_on_a_busy_guest_are_paid_by_its_next_steps():
    """The device's time is conserved: segments a driver runs on d1 while t1 decodes there stretch t1's next steps
    by their time (its own busy time = its own work + the segments), none is left owed, and the device worked
    what the anatomy's busy bins record."""
    own = [WorkloadRequest(f"b{i}", 0.1 + 0.001 * i, "t1", 50, 300) for i in range(2)]
    sim, r = _run_segments(own)
    d1 = sim.devices["d1"]
    assert d1.guest_busy_s > 0.03  # segments ran on d1 while t1 had work
    assert d1.busy_s == pytest.approx(d1.work_s, abs=1e-9)  # own steps (stretched) = own work + segments
    assert d1.seg_debt == 0.0
    alone, _ = _run_segments(own, share=0.0)  # no segments: t1's steps run unstretched
    assert sim.devices["d1"].busy_s == pytest.approx(alone.devices["d1"].busy_s + d1.guest_busy_s, rel=0.02)
    for d in sim.devices.values():
        assert d.work_s == pytest.approx(sum(d.bins.own) + sum(d.bins.guest))
    assert r.total["device_busy_mean"] <= 1.0


def test_segments_run_on_an_idle_guest_cost_it_nothing():
    sim, _ = _run_segments([])
    d1 = sim.devices["d1"]
    assert d1.guest_busy_s > 0.03 and d1.busy_s == 0.0 and d1.seg_debt == 0.0
    assert d1.work_s == pytest.approx(d1.guest_busy_s)
