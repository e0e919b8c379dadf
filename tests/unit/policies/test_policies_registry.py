"""Every registered policy runs through the simulator on a small workload; registry and config errors are clear."""
from __future__ import annotations

import random

import pytest

from shared.policies import POLICIES, PolicyConfigError, make_policy
from shared.policies.actions import ExtendLease, Trigger
from shared.policies.sizing import device_counts
from shared.registry import UnknownNameError
from shared.sim import SimConfig, Simulator
from shared.sim.synthetic import bursty_workload, small_cluster, small_tenants

EXPECTED = {"container", "container-avgwork", "container-realloc", "muxserve", "token-pool", "slice", "pooled"}


def test_registry_has_every_policy():
    assert EXPECTED <= set(POLICIES.names())
    assert POLICIES.get("pooled-bound").simulation_only


def test_unknown_policy_lists_valid_names():
    with pytest.raises(UnknownNameError) as e:
        make_policy("nope")
    assert "container" in str(e.value) and "slice" in str(e.value)


def test_bad_policy_parameter_is_named():
    with pytest.raises(PolicyConfigError, match="bogus"):
        make_policy("slice", {"bogus": 1})
    with pytest.raises(PolicyConfigError, match="lease_s"):
        make_policy("slice", {"lease_s": "long"})
    assert make_policy("slice", {"lease_s": "3"}).config.lease_s == 3.0


@pytest.fixture(scope="module")
def small():
    c = small_cluster(6, 3)
    t = small_tenants(c, ["llama-7b", "llama-7b", "llama-7b", "llama-13b"])
    w = bursty_workload(t, [8.0, 2.0, 0.5, 0.5], 40.0, random.Random(4), burst_factor=6.0)
    return c, t, w


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_policy_runs_and_keeps_memory_safe(small, name):
    c, t, w = small
    sim = Simulator(c, t, make_policy(name), SimConfig(), random.Random(0))
    r = sim.run(w)
    assert r.total["requests"] == len(w.requests)
    assert r.total["completed"] > 0.9 * len(w.requests)
    assert 0.0 <= r.violation_rate <= 1.0 and r.tokens_per_s > 0
    for d in sim.devices.values():
        assert all(b <= d.mem.limit for _, b in d.mem.timeline), d.id
    assert r.policy["name"] == name


def test_container_sizing_is_proportional_with_minimum_one():
    counts = device_counts({"a": 10.0, "b": 5.0, "c": 0.1, "d": 0.0}, 8)
    assert counts == {"a": 4, "b": 2, "c": 1, "d": 1}
    assert sum(device_counts({"a": 3.0, "b": 1.0}, 32).values()) == 32
    with pytest.raises(PolicyConfigError):
        device_counts({"a": 1.0, "b": 1.0, "c": 1.0}, 2)


def test_container_routes_to_least_loaded_device_of_its_container(small):
    c, t, w = small
    sim = Simulator(c, t, make_policy("container-avgwork"), SimConfig(), random.Random(0))
    sim.run(w)
    pol = sim.policy
    assert sorted(d for ds in pol.devices_of.values() for d in ds) == sorted(d.id for d in c.devices)
    assert len(pol.devices_of["t0"]) >= len(pol.devices_of["t3"])  # the busiest tenant got the most devices
    for r in sim.requests:  # a request only ever ran on its own tenant's container
        if r.engine is not None:
            assert r.engine.device.id in pol.devices_of[r.tenant]


def test_slice_leases_help_the_bursty_tenant_without_hurting_the_others(small):
    c, t, _ = small
    # long prompts in 10x bursts: the busy tenant's container queues prompts during bursts
    w = bursty_workload(t, [15.0, 1.0, 0.3, 0.3], 40.0, random.Random(4), burst_factor=10.0, mean_input=2000,
                        mean_output=40)
    res = {}
    for name in ("container", "slice"):
        sim = Simulator(c, t, make_policy(name), SimConfig(), random.Random(0))
        res[name] = sim.run(w)
    s, k = res["slice"], res["container"]
    assert s.leases["granted"] > 0
    assert k.violation_rate > 0 and s.violation_rate <= k.violation_rate
    hot = "t0"
    assert s.tenants[hot]["ttft_ms"]["p99"] <= k.tenants[hot]["ttft_ms"]["p99"]
    for other in ("t1", "t2", "t3"):  # guests' own tenants stay inside their SLA
        assert s.tenants[other]["violation_rate"] <= k.tenants[other]["violation_rate"]


def test_slice_without_segment_leases_grants_only_sequences(small):
    c, t, _ = small
    w = bursty_workload(t, [15.0, 1.0, 0.3, 0.3], 40.0, random.Random(4), burst_factor=10.0, mean_input=2000,
                        mean_output=40)
    modes = {}
    for segments in (True, False):
        sim = Simulator(c, t, make_policy("slice", {"segments": segments, "resize": True}), SimConfig(),
                        random.Random(0))
        sim.run(w)
        modes[segments] = {lz.mode for lz in [*sim.leases.leases.values(), *sim.leases.finished]}
    assert "segments" in modes[True]  # the workload does get segment leases when they are allowed
    assert modes[False] == {"sequences"}


def test_slice_opens_no_sequences_lane_inside_its_own_container(small):
    """The hot tenant has several devices; its "sequences" lanes go to other tenants' devices only (a lane on its
    own container's device would stage a second copy of weights routing can already use)."""
    c, t, _ = small
    w = bursty_workload(t, [15.0, 1.0, 0.3, 0.3], 40.0, random.Random(4), burst_factor=10.0, mean_input=2000,
                        mean_output=40)
    pol = make_policy("slice", {"resize": True})  # containers sized by average work: t0 gets several devices
    sim = Simulator(c, t, pol, SimConfig(), random.Random(0))
    sim.run(w)
    lanes = [lz for lz in [*sim.leases.leases.values(), *sim.leases.finished] if lz.mode == "sequences"]
    assert lanes and len(pol.devices_of["t0"]) > 1
    assert all(lz.guest_dev.id not in pol.devices_of[lz.tenant] for lz in lanes)


def test_slice_asks_every_candidate_guest_for_a_lane_but_commits_within_the_cap(small, monkeypatch):
    """A home that already holds lanes still gets a `sequences` candidate on every candidate guest (not only on
    the first few of the ranking), and never holds more than `max_sequence_leases` lanes at once."""
    from shared.sim.whatif import WhatIf
    c, t, _ = small
    w = bursty_workload(t, [15.0, 1.0, 0.3, 0.3], 40.0, random.Random(4), burst_factor=10.0, mean_input=2000,
                        mean_output=40)
    cap = 2
    asked = []  # (lanes the home held, sequences candidates asked about)
    evaluate = WhatIf.evaluate

    def spy(self, snapshot, candidates, horizon_s=1.0):
        seq = [x for x in candidates if x.mode == "sequences"]
        if seq:
            home = seq[0].home_device
            held = sum(1 for lz in snapshot.leases.values() if lz.home_device == home and lz.mode == "sequences"
                       and lz.state != "draining")
            asked.append((held, len(seq)))
        return evaluate(self, snapshot, candidates, horizon_s)

    monkeypatch.setattr(WhatIf, "evaluate", spy)
    sim = Simulator(c, t, make_policy("slice", {"max_sequence_leases": cap, "segments": False}), SimConfig(),
                    random.Random(0))
    held_max = {}
    grant = sim.leases.grant

    def count(a):
        lease = grant(a)
        if lease is not None and a.mode == "sequences":
            n = sum(1 for lz in sim.leases.leases.values() if lz.engine.device.id == a.home_device
                    and lz.mode == "sequences" and lz.state != "draining")
            held_max[a.home_device] = max(held_max.get(a.home_device, 0), n)
        return lease

    sim.leases.grant = count
    sim.run(w)
    assert any(held >= 1 and n > cap - held for held, n in asked)  # more guests asked than lanes left
    assert held_max and max(held_max.values()) <= cap


@pytest.mark.parametrize("size,behind,fraction,devices,expected", [
    (4, "a", 0.5, 0, False),  # one loaded device of four: routing balances it, no lease
    (4, "ab", 0.5, 0, True),  # half the container behind: lease
    (4, "a", 0.0, 0, True),  # the per-device rule alone
    (4, "a", 0.25, 0, True),
    (8, "ab", 0.5, 0, False),  # two of eight: not half
    (8, "ab", 0.5, 2, True),  # ... but two devices are enough with tenant_behind_devices 2
    (8, "a", 0.5, 2, False),
    (4, "a", 0.5, 2, False),  # in a container of four, two devices is half of it: the rules agree
    (8, "abc", 0.5, 5, False),  # the fraction's 4 is the fewer
])
def test_slice_seeks_for_a_tenant_only_when_enough_of_its_container_is_behind(size, behind, fraction, devices,
                                                                              expected):
    from types import SimpleNamespace
    pol = make_policy("slice", {"tenant_behind_fraction": fraction, "tenant_behind_devices": devices})
    ids = "abcdefgh"[:size]
    pol.devices_of = {"t0": list(ids)}
    # every device has work (a device with nothing to run is never behind, and is not asked)
    devs = {i: SimpleNamespace(id=i, home_tenant="t0", draining=False, running=1, queued_prefill_tokens=0)
            for i in ids}
    snap = SimpleNamespace(devices=devs)
    pol._behind = lambda d, s, w: d.id in set(behind)
    assert pol._tenant_behind("t0", devs["a"], snap, None) is expected


@pytest.mark.parametrize("stay,all_home", [(0.5, True), (0.0, False)])
def test_pooled_serves_a_light_load_at_home_as_container_does(stay, all_home):
    """A bound must not lose to `container` where containers suffice: under light load every request stays on its
    tenant's own devices (without the rule the bound spreads them and slows decoding where tenants mix)."""
    c = small_cluster(6, 3)
    t = small_tenants(c, ["llama-7b", "llama-7b", "llama-7b", "llama-13b"])
    w = bursty_workload(t, [1.0, 0.5, 0.5, 0.3], 20.0, random.Random(2), burst_factor=1.0, mean_input=300)
    sim = Simulator(c, t, make_policy("pooled", {"stay_fraction": stay}), SimConfig(), random.Random(0))
    sim.run(w)
    home = [r.engine.device.id for r in sim.requests if sim.snapshot.devices[r.engine.device.id].home_tenant == r.tenant]
    assert (len(home) == len(sim.requests)) is all_home


def test_policy_params_merge_and_containers(small):
    from shared.policies import policy_params
    assert policy_params("slice", {"segments": False, "lease_s": 2.0}, {"lease_s": 3.0}) == \
        {"segments": False, "lease_s": 3.0}
    c, t, w = small
    homes = {}
    for name in ("container", "container-avgwork", "slice", "token-pool", "pooled", "container-realloc"):
        sim = Simulator(c, t, make_policy(name), SimConfig(), random.Random(0))
        sim._place(w)
        homes[name] = {d.id: sorted(e.tenant for e in d.engines) for d in sim.devices.values()}
    # every policy but container-avgwork starts from the tenants' home devices (one each, two devices idle)
    for name in ("container", "slice", "token-pool", "pooled", "container-realloc"):
        assert homes[name] == {"d0": ["t0"], "d1": ["t1"], "d2": ["t2"], "d3": ["t3"], "d4": [], "d5": []}, name
    assert all(homes["container-avgwork"].values())  # sized by average work over every device


def test_slice_share_for_a_guest_passes_the_what_ifs_own_check_on_that_guest():
    """The share ``slice`` offers a busy guest is the largest its own tenant can spare (its predicted TTFT/TPOT
    stay under ``guest_margin`` × SLA); the what-if checks the same latency with that share and must not refuse
    it. A share exactly on the bound came back a rounding error over it (87.20000000000002 > 87.2 ms) and the
    best guests of a burst were refused. Nor may the guest's promised time go past 0.95."""
    from shared.config import SLA
    from shared.model.config import PRESETS
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, TenantState
    from shared.sim.whatif import WhatIf

    pol = make_policy("slice")
    whatif = WhatIf()
    rng = random.Random(7)
    bound = 0  # cases where the guest's SLA, not share_max, set the share
    for _ in range(400):
        ten = TenantState("g", PRESETS["llama-7b"], SLA(ttft_ms=rng.uniform(60, 400), tpot_ms=rng.uniform(20, 80)),
                          ["d1"], mean_input=rng.choice([128, 700, 1046, 2048]), mean_output=rng.choice([16, 90, 300]))
        g = DeviceState("d1", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="g", tenants=["g"], busy=True,
                        running=rng.randint(0, 40), queued_prefill_tokens=rng.choice([0, 0, 512, 3000]),
                        decode_kv_tokens=rng.randint(0, 60_000),
                        guest_share=rng.choice([0.0, 0.05, 0.2, 0.45, 0.37 + rng.random() / 10]))
        snap = ClusterSnapshot(now=1.0, devices={"d1": g}, tenants={"g": ten})
        share = pol._share_for(g, snap, whatif)
        assert g.guest_share + share <= 0.95  # the what-if and the lease book refuse more ("share")
        if share < 0.05 or share >= min(pol.cfg.share_max, 0.95 - g.guest_share) - 1e-9:
            continue
        bound += 1
        breaks: list[str] = []
        whatif._guest_side(snap, g, share, 1.0, breaks)
        assert "guest_ttft" not in breaks and "guest_tpot" not in breaks, (share, breaks)
    assert bound >= 20  # the sweep reaches the bound often enough to mean something


@pytest.mark.parametrize("trigger", [Trigger("arrival", tenant="t0", device="a"), Trigger("lease_end", tenant="t0"),
                                     Trigger("lease_revoked", tenant="t0")])
def test_slice_commits_every_lease_its_search_picked_whatever_the_trigger(trigger):
    """A search may pick up to ``max_commits`` leases (the best first); every trigger that searches commits all
    of them — a lease ending used to commit only the first, dropping the rest."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from shared.policies.actions import GrantLease
    pol = make_policy("slice")
    pol.devices_of = {"t0": ["a"]}
    grants = [GrantLease("t0", "a", g, ("*",), 5.0, 0.5, 0, mode="sequences") for g in ("b", "c", "d")]

    def seek(d, snapshot, whatif):
        pol._extra = grants[1:]
        return grants[0]
    pol._seek = seek
    pol._protect = lambda d, s, w: []
    snap = SimpleNamespace(devices={"a": SimpleNamespace(id="a")}, leases={})
    assert pol.decide(trigger, snap, SimpleNamespace(same_snapshot=nullcontext)) == grants
    assert pol._extra == []


def test_slice_closes_a_lane_that_became_too_slow_to_new_requests_and_lets_it_end():
    """A "sequences" lease granted while its guest's own tenant was away goes on running when that tenant comes
    back, and every lane token then waits for one of its iterations: on each tick ``slice`` prices the lane again
    and, past ``guest_margin`` × the leasing tenant's TPOT target, routes no new request there and stops extending
    the lease (ServeGen: lane requests had run at 1.5× the target, half of them violating)."""
    from shared.config import SLA
    from shared.model.config import PRESETS
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, LeaseTable, TenantState
    from shared.sim.whatif import WhatIf

    pol = make_policy("slice", {"segments": False})
    pol.devices_of = {"a": ["h"], "b": ["g"]}
    sla = SLA(ttft_ms=200, tpot_ms=30)
    tenants = {"a": TenantState("a", PRESETS["llama-7b"], sla, ["h"], mean_input=1000, mean_output=100),
               "b": TenantState("b", PRESETS["llama-7b"], sla, ["g"], mean_input=1000, mean_output=100)}
    home = DeviceState("h", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="a", tenants=["a"], busy=True,
                       running=64, queued=30, queued_prefill_tokens=40_000, decode_kv_tokens=64 * 1000)
    guest = DeviceState("g", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="b", tenants=["b", "a"],
                        guest_share=0.6, guest_engines={"a": (2, 0, True)})
    lease = LeaseState("L", "a", "h", "g", ("*",), 0.0, 1.05, 0, 0.6, mode="sequences", state="active")
    snap = ClusterSnapshot(now=1.0, devices={"h": home, "g": guest}, tenants=tenants, leases=LeaseTable({"L": lease}))
    whatif = WhatIf()
    tick = Trigger("tick")

    def extended():
        return any(isinstance(a, ExtendLease) and a.lease_id == "L" for a in pol.decide(tick, snap, whatif))

    assert extended() and "L" not in pol._closed  # its guest's tenant is gone: the lane is fast
    assert pol.route("a", 1000, 100, snap) == "g"  # and takes the request the home would keep waiting
    tenants["b"].rate_rps = 2.0  # the guest's tenant is back: prompts to prefill, its own decode beside the lane
    guest.busy, guest.running, guest.decode_kv_tokens = True, 48, 48 * 1500
    guest.guest_yield = 0.5  # it yields half its time: on prompt wait alone the lane would still win
    assert not extended() and "L" in pol._closed
    assert pol.route("a", 1000, 100, snap) == "h"


def test_slice_keeps_a_hand_off_lane_open_on_a_slow_guest_while_its_home_can_take_the_sequences_back():
    """A lane granted with the hand-off only prefills: its sequences decode in the home's batch once their KV has
    crossed, so a guest whose own decoding would make the lane's tokens slow does not make its requests' tokens
    slow. ``slice`` prices such a lane by the lane's TPOT only while its home lacks the memory to take the
    sequences back (then they would decode on the guest)."""
    from shared.config import SLA
    from shared.model.config import PRESETS
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, LeaseTable, TenantState
    from shared.sim.whatif import WhatIf

    pol = make_policy("slice", {"segments": False})
    pol.devices_of = {"a": ["h"], "b": ["g"]}
    sla = SLA(ttft_ms=200, tpot_ms=30)
    tenants = {"a": TenantState("a", PRESETS["llama-7b"], sla, ["h"], mean_input=1000, mean_output=100),
               "b": TenantState("b", PRESETS["llama-7b"], sla, ["g"], mean_input=1000, mean_output=100,
                                rate_rps=2.0)}
    home = DeviceState("h", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="a", tenants=["a"], busy=True,
                       running=64, queued=30, queued_prefill_tokens=40_000, decode_kv_tokens=64 * 1000,
                       used_bytes=40 << 30)
    guest = DeviceState("g", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="b", tenants=["b", "a"], busy=True,
                        running=48, decode_kv_tokens=48 * 1500, guest_share=0.6, guest_yield=0.5,
                        guest_engines={"a": (2, 0, True)})
    lease = LeaseState("L", "a", "h", "g", ("*",), 0.0, 1.05, 0, 0.6, mode="sequences", state="active",
                       handback=True)
    snap = ClusterSnapshot(now=1.0, devices={"h": home, "g": guest}, tenants=tenants, leases=LeaseTable({"L": lease}))
    whatif = WhatIf()
    tick = Trigger("tick")

    def extended():
        return any(isinstance(a, ExtendLease) and a.lease_id == "L" for a in pol.decide(tick, snap, whatif))

    assert whatif.decodes_home(tenants["a"], home)
    assert extended() and "L" not in pol._closed  # the home takes its sequences back: the lane stays open
    home.used_bytes = home.limit_bytes - (1 << 30)  # the home's memory is full: they would decode on the guest
    assert not whatif.decodes_home(tenants["a"], home)
    assert not extended() and "L" in pol._closed


def _one_lane(tenants: dict, running: int, lane_queued: int, home_queued: int = 0):
    """Tenant ``a``'s home ``h`` decoding ``running`` sequences of 2,000 positions with ``home_queued`` prompt tokens
    queued, and one open hand-off lane of it on ``b``'s busy device ``g`` with ``lane_queued`` queued; returns
    ``route(input_tokens, **params)`` of a fresh ``slice`` (no segments) on that snapshot."""
    from shared.policies.snapshot import ClusterSnapshot, DeviceState, LeaseState, LeaseTable

    home = DeviceState("h", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="a", tenants=["a"], busy=True,
                       running=running, queued_prefill_tokens=home_queued, decode_kv_tokens=running * 2000)
    guest = DeviceState("g", "h100-80gb", "h0", 80 << 30, 4 << 30, home_tenant="b", tenants=["b", "a"],
                        busy=True, running=8, decode_kv_tokens=8 * 1000, guest_share=0.6, guest_yield=0.5,
                        guest_engines={"a": (0, lane_queued, True)})
    lease = LeaseState("L", "a", "h", "g", ("*",), 0.0, 1.05, 0, 0.6, mode="sequences", state="active",
                       handback=True)
    snap = ClusterSnapshot(now=1.0, devices={"h": home, "g": guest}, tenants=tenants, leases=LeaseTable({"L": lease}))

    def route(input_tokens: int, **params) -> str:
        pol = make_policy("slice", {"segments": False, **params})
        pol.devices_of = {"a": ["h"], "b": ["g"]}
        return pol.route("a", input_tokens, 500, snap)

    return route


def test_slice_sends_a_prompt_to_a_hand_off_lane_while_its_homes_decode_step_is_near_the_tpot_target():
    """A prompt prefilled at home adds its chunks to the steps of the home's whole batch. When the home's decode
    step alone is already past ``lane_tpot_fraction`` × the TPOT target, ``slice`` sends the prompt to an open
    hand-off lane that can still meet the TTFT target, even if the home's prompt queue is shorter (ServeGen's
    long-prompt tenant: most of its violations were TPOT misses after a prefill at home). Off with the fraction 0,
    without the hand-off (the sequence would then decode on the guest), or while the home's step is light."""
    from shared.config import SLA
    from shared.costmodel import cost_for
    from shared.model.config import PRESETS
    from shared.policies.snapshot import TenantState

    model = PRESETS["llama-7b"]
    step = cost_for(model, "h100-80gb").iteration_time(64, 64 * 2000)
    sla = SLA(ttft_ms=2000, tpot_ms=step * 1e3 / 0.9)  # the home's step alone is 0.9 × the TPOT target
    tenants = {"a": TenantState("a", model, sla, ["h"], mean_input=2000, mean_output=500),
               "b": TenantState("b", model, sla, ["g"], mean_input=1000, mean_output=100, rate_rps=1.0)}

    def route(params: dict, running: int = 64) -> str:
        return _one_lane(tenants, running, 4000)(2000, **params)

    assert make_policy("slice").config.lane_tpot_fraction == 0.8
    assert route({}) == "g"  # the home's queue is empty, but its step is tight: the lane prefills it
    assert route({"lane_tpot_fraction": 0.0}) == "h"  # off: the shorter queue wins
    assert route({"lane_handback": False}) == "h"  # it would decode on the guest
    assert route({"lane_tpot_fraction": 0.95}) == "h"  # 0.9 × the target is not past 0.95 ×
    assert route({}, running=8) == "h"  # a light batch: prefilling at home costs its steps little


def test_slice_holds_a_tpot_tight_prompt_to_its_own_ttft_target_when_it_picks_a_hand_off_lane():
    """Under a per-request SLA each prompt has its own TTFT target (``slowdown`` × its isolated TTFT): a short
    prompt's is far below the reference request's. ``slice`` sends a prompt from a TPOT-tight home to a hand-off
    lane only while the lane's predicted wait is within that prompt's own target, not the tenant's reference one."""
    from shared.config import SLA
    from shared.costmodel import cost_for
    from shared.model.config import PRESETS
    from shared.policies.snapshot import TenantState

    model = PRESETS["llama-7b"]
    cost = cost_for(model, "h100-80gb")
    step = cost.iteration_time(64, 64 * 2000)
    per_token = cost.prefill_time(2048) / 2048
    lane_wait = {n: (4000 + n) * per_token / 0.5 for n in (2000, 3000)}  # 4,000 queued tokens at half the guest
    own = {n: 5 * cost.isolated_latency(n, 500)[0] for n in (2000, 3000)}
    assert own[2000] < lane_wait[2000] < 2.0 and lane_wait[3000] < own[3000]  # the case this test is about

    def route(sla: SLA, input_tokens: int) -> str:
        tenants = {"a": TenantState("a", model, sla, ["h"], mean_input=2000, mean_output=500),
                   "b": TenantState("b", model, sla, ["g"], mean_input=1000, mean_output=100, rate_rps=1.0)}
        return _one_lane(tenants, 64, 4000)(input_tokens)

    tpot_ms = step * 1e3 / 0.9  # the home's decode step alone is 0.9 × the (reference) TPOT target
    assert route(SLA(ttft_ms=2000, tpot_ms=tpot_ms), 2000) == "g"  # a fixed 2 s target: the lane meets it
    per_request = SLA(ttft_ms=2000, tpot_ms=tpot_ms, slowdown=5, kind="h100-80gb")
    assert route(per_request, 2000) == "h"  # its own target is shorter than the lane's wait: it stays home
    assert route(per_request, 3000) == "g"  # a longer prompt's own target covers the lane's wait


def test_slice_prices_a_homes_prompt_queue_beside_its_decode_batch():
    """Each iteration of a home that still decodes a batch carries only the prompt rows the chunk budget leaves and
    also steps that batch, so its prompt queue drains slower than at the device's full prefill speed. ``slice``
    compares a lane's wait with that: a prompt whose home queue looks shorter at full speed goes to the lane when
    the home is busy decoding, and stays home when the home has no batch or the lane would decode it too (no
    hand-off)."""
    from shared.config import SLA
    from shared.costmodel import cost_for
    from shared.model.config import PRESETS
    from shared.policies.slice import PREFILL_CHUNK
    from shared.policies.snapshot import TenantState

    model = PRESETS["llama-7b"]
    cost = cost_for(model, "h100-80gb")
    per_token = cost.prefill_time(PREFILL_CHUNK) / PREFILL_CHUNK
    running, queued, prompt = 128, 1000, 2000
    full_speed = (queued + prompt) * per_token
    lane_wait = prompt * per_token / 0.5  # an empty lane queue at half the guest
    it, rows = cost.chunk_iteration(running, running * 2000, PREFILL_CHUNK, PREFILL_CHUNK)
    beside = -(-(queued + prompt) // rows) * it
    assert full_speed < lane_wait < beside  # the case this test is about
    sla = SLA(ttft_ms=5000, tpot_ms=1000)  # loose: the TPOT-tight path stays out of it
    tenants = {"a": TenantState("a", model, sla, ["h"], mean_input=2000, mean_output=500),
               "b": TenantState("b", model, sla, ["g"], mean_input=1000, mean_output=100, rate_rps=1.0)}

    def route(batch: int, **params) -> str:
        return _one_lane(tenants, batch, 0, queued)(prompt, **params)

    assert route(running) == "g"
    assert route(0) == "h"  # no batch: the queue drains at full speed, shorter than the lane's wait
    assert route(running, lane_handback=False) == "h"  # the lane would decode it too: the home at full speed


def test_slice_keeps_a_prompt_home_while_its_wait_there_is_well_within_its_ttft_target_with_lane_wait_fraction():
    """With no prompt queued at the home, a lane's shorter wait takes a prompt only once the home's predicted wait
    is past ``lane_wait_fraction`` × the prompt's TTFT target (0: whenever it is shorter). At low load a home well
    within its target keeps its prompts, and the guest's own tenant is spared the lane's prefill chunks (one-device
    tenants hosting lanes missed their TTFT target behind them). A home with prompts queued, or whose decode step alone
    is past ``home_step_fraction`` × the TPOT target, sends it on whatever the fraction: a chunk there costs the steps
    of a batch near its target (keeping prompts at such homes lost one-device tenants to TPOT misses at high load)."""
    from shared.config import SLA
    from shared.costmodel import cost_for
    from shared.model.config import PRESETS
    from shared.policies.slice import PREFILL_CHUNK
    from shared.policies.snapshot import TenantState

    model = PRESETS["llama-7b"]
    cost = cost_for(model, "h100-80gb")
    running, prompt = 128, 2000
    it, rows = cost.chunk_iteration(running, running * 2000, PREFILL_CHUNK, PREFILL_CHUNK)
    home_wait = -(-prompt // rows) * it
    lane_wait = prompt * cost.prefill_time(PREFILL_CHUNK) / PREFILL_CHUNK / 0.5
    assert lane_wait < home_wait  # the lane is sooner: without the fraction it takes the prompt
    ttft_ms = 4 * home_wait * 1e3  # the home's wait is a quarter of the target
    sla = SLA(ttft_ms=ttft_ms, tpot_ms=1000)  # loose TPOT: the TPOT-tight path stays out of it
    tenants = {"a": TenantState("a", model, sla, ["h"], mean_input=2000, mean_output=500),
               "b": TenantState("b", model, sla, ["g"], mean_input=1000, mean_output=100, rate_rps=1.0)}
    route = _one_lane(tenants, running, 0)

    assert make_policy("slice").config.lane_wait_fraction == 0.0
    assert route(prompt) == "g"
    assert route(prompt, lane_wait_fraction=0.2) == "g"  # 0.25 × the target is past 0.2 ×: the lane
    assert route(prompt, lane_wait_fraction=0.3) == "h"  # within 0.3 ×: the home keeps it
    assert route(prompt, lane_wait_fraction=0.6) == "h"
    # 100 prompt tokens queued at the home: two chunks, half the target (within 0.6 ×), yet the lane takes it
    queued = _one_lane(tenants, running, 0, home_queued=100)
    assert queued(prompt, lane_wait_fraction=0.6) == "g"
    # the home's decode step alone at 0.6 × its TPOT target: past home_step_fraction (0.4), so the lane takes it,
    # though the step is within lane_tpot_fraction (0.8) and the wait within 0.6 × the TTFT target
    step = cost.iteration_time(running, running * 2000)
    near = SLA(ttft_ms=ttft_ms, tpot_ms=step * 1e3 / 0.6)
    busy = _one_lane({**tenants, "a": TenantState("a", model, near, ["h"], mean_input=2000, mean_output=500)},
                     running, 0)
    assert busy(prompt, lane_wait_fraction=0.6) == "g"
    assert busy(prompt, lane_wait_fraction=0.6, home_step_fraction=0.7) == "h"
