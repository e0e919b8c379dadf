"""Staged-weight LRU and pins, guest segment statistics in step reports, the emulated lease agent's timing."""
from __future__ import annotations

import asyncio

import pytest

from services.worker.core import StepAggregator
from services.worker.emulated import EmulatedEngine
from services.worker.emulated_leases import EmulatedLeaseAgent
from services.worker.guest import StagedWeights
from shared.config import parse_cluster, parse_tenants
from shared.guest_share import MAX_OWED_S
from shared.messages import LeaseGranted, LeaseRevoked
from shared.model.config import PRESETS
from shared.model.engine import SamplingParams
from shared.model.llama import LlamaModel


def test_staged_weights_lru_order_pins_and_drop():
    cfg = PRESETS["tiny-2l"]
    home = LlamaModel(cfg, seed=1)
    w = StagedWeights("cpu")
    for seg in ("mlp[0]", "mlp[1]"):
        w.put("a", cfg, seg, home.segment_state_dict(seg))
    w.put("b", cfg, "mlp[0]", home.segment_state_dict("mlp[0]"))
    one = home.segment_weight_bytes("mlp[0]")
    assert w.nbytes == 3 * one and w.has("a", "mlp[1]")
    w.get("a", "mlp[0]")  # used: now most recent
    assert [(t, s) for t, s, _ in w.evictable(set())] == [("a", "mlp[1]"), ("b", "mlp[0]"), ("a", "mlp[0]")]
    assert [(t, s) for t, s, _ in w.evictable({("a", "mlp[1]")})] == [("b", "mlp[0]"), ("a", "mlp[0]")]
    assert w.drop("a", "mlp[1]") == one and not w.has("a", "mlp[1]")
    assert "mlp[1]" not in w.models["a"].segments and w.nbytes == 2 * one
    with pytest.raises(ValueError, match="missing tensor"):
        w.put("a", cfg, "mlp[1]", {})


def test_guest_segments_reach_the_step_report_without_counting_as_home_busy():
    agg = StepAggregator("cpu1", "tb")
    agg.add_segment("ta/mlp[0]", 8, 1.5)
    agg.add_segment("ta/mlp[0]", 7, 2.5)
    rep = agg.flush(0)
    assert rep is not None and rep.steps == 0 and rep.busy_ms == 0 and rep.busy_intervals == []
    (st,) = rep.segments
    assert (st.segment, st.tokens_bucket, st.count, st.total_ms) == ("ta/mlp[0]", 8, 2, 4.0)
    assert agg.flush(0) is None


CLUSTER = parse_cluster({"devices": [{"id": "h0", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80},
                                     {"id": "g0", "backend": "emulated", "kind": "h100-80gb", "memory_gb": 80}],
                         "links": {"intra_host": "nvlink"}})
TENANTS = parse_tenants({"tenants": [
    {"name": "a", "model": "llama-7b", "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["h0"]},
    {"name": "b", "model": "llama-7b", "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["g0"]}]},
    cluster=CLUSTER)


def _agent(device: str, clock, lanes=None) -> tuple[EmulatedLeaseAgent, EmulatedEngine]:
    t = TENANTS.tenants[0 if device == "h0" else 1]
    eng = EmulatedEngine(t.model.config, "h100-80gb", kv_blocks=4096, noise_sigma=0.0, sleep=lambda s: None)
    return EmulatedLeaseAgent(cluster=CLUSTER, device=CLUSTER.device(device), tenant=t, tenants=TENANTS,
                              engine=eng, clock=clock, lanes=lanes), eng


def _lease(now: float, share: float) -> LeaseGranted:
    return LeaseGranted(msg_id="m", lease_id="L", tenant="a", home_device="h0", guest_device="g0",
                        segments=[f"mlp[{i}]" for i in range(32)], start_ts=now, end_ts=now + 10, share=share)


def test_emulated_driver_iterations_get_shorter_and_guest_iterations_longer_under_a_lease():
    now = [1000.0]
    drv, deng = _agent("h0", lambda: now[0])
    gst, geng = _agent("g0", lambda: now[0])
    for eng in (deng, geng):
        for i in range(32):
            eng.add(f"r{i}", [5] * 64, SamplingParams(max_tokens=50, ignore_eos=True))
    plan = deng._plan()  # a prefill-heavy iteration: where the cost model says offloading MLPs pays
    base = deng.predicted_s(plan)
    assert drv.iteration_time(plan, base) == base  # no lease yet
    asyncio.run(drv.on_message(_lease(now[0], 1.0)))
    asyncio.run(gst.on_message(_lease(now[0], 0.5)))
    leased = drv.iteration_time(plan, base)
    assert leased < base and drv.iterations_leased == 1
    gplan = geng._plan()
    gbase = geng.predicted_s(gplan)
    assert gst.iteration_time(gplan, gbase) == pytest.approx(gbase / 0.5)  # worst case: the lease's whole share
    h = drv.health_fields()
    assert h["leases_driver"] == "L:active" and h["lease_timing"] == "emulated"
    assert gst.health_fields()["leases_guest"] == "L:active"
    asyncio.run(drv.on_message(LeaseRevoked(msg_id="r", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0")))
    assert drv.iteration_time(plan, base) == base
    now[0] += 100  # a lease past its window no longer counts even without a revoke
    assert gst.iteration_time(gplan, gbase) == gbase
    deng.step()  # the hook is wired into the engine's step
    assert deng.time_hook == drv.iteration_time


def _same_process_pair(now: list[float], lanes=None):
    """An emulated driver h0 (with a prefill-heavy batch) and guest g0 (with guest ``lanes``) in one process:
    (peers, driver, its engine, guest, its engine, the driver's plan, its predicted time)."""
    from services.worker.emulated_leases import EmulatedPeers

    peers = EmulatedPeers()
    drv, deng = _agent("h0", lambda: now[0])
    gst, geng = _agent("g0", lambda: now[0], lanes)
    for a in (drv, gst):
        a.peers = peers
        peers.add(a)
    for i in range(32):
        deng.add(f"r{i}", [5] * 64, SamplingParams(max_tokens=50, ignore_eos=True))
    plan = deng._plan()
    return peers, drv, deng, gst, geng, plan, deng.predicted_s(plan)


def test_a_same_process_driver_charges_its_guest_what_it_used_not_the_whole_share():
    now = [1000.0]
    peers, drv, deng, gst, geng, plan, base = _same_process_pair(now)
    asyncio.run(drv.on_message(_lease(now[0], 1.0)))  # as in the test above: where offloading pays
    asyncio.run(gst.on_message(_lease(now[0], 0.5)))
    # the guest's own tenant is idle: what the driver ran there cost it nothing
    assert drv.iteration_time(plan, base) < base
    assert gst.charged_s > 0 and gst.owed_s == 0.0
    geng.add("g", [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    gplan = geng._plan()
    gbase = geng.predicted_s(gplan)
    assert gst.iteration_time(gplan, gbase) == gbase  # nothing owed, and no worst-case stretch
    # now the guest's tenant has work: the next offloaded iteration is owed and paid from its own iterations,
    # at most share / (1 - share) of each (here 1×), the rest carried
    before = gst.charged_s
    drv.iteration_time(plan, base)
    used = gst.charged_s - before
    assert used > 0 and gst.owed_s == pytest.approx(min(MAX_OWED_S, used))
    owed = gst.owed_s
    t = gst.iteration_time(gplan, gbase)
    assert t == pytest.approx(gbase + min(owed, gbase))
    assert gst.owed_s == pytest.approx(owed - (t - gbase))
    asyncio.run(gst.close())
    assert peers.get("g0") is None and peers.get("h0") is drv


def test_segments_run_while_a_guest_lane_works_are_owed_and_lane_iterations_pay_them():
    """The guest's own tenant is idle but a guest lane ("sequences" lease) has work there: the device is busy, so
    what the driver ran is owed, and the lane's iterations pay it as the own tenant's would."""
    from services.worker.lanes import GuestLanes

    now = [1000.0]
    lanes = GuestLanes({"a": TENANTS.tenants[0]}, lambda t, kv: EmulatedEngine(
        t.model.config, "h100-80gb", kv_blocks=kv, noise_sigma=0.0, sleep=lambda s: None), lambda t: 4096)
    peers, drv, deng, gst, geng, plan, base = _same_process_pair(now, lanes)
    asyncio.run(drv.on_message(_lease(now[0], 1.0)))
    asyncio.run(gst.on_message(_lease(now[0], 0.5)))
    lanes.on_granted(LeaseGranted(msg_id="s", lease_id="S", tenant="a", home_device="h0", guest_device="g0",
                                  segments=["*"], start_ts=now[0], end_ts=now[0] + 10, share=0.3, mode="sequences"))
    lanes.stage("a")
    lane = lanes.engine_for("a")
    assert lane.time_hook == gst.lane_time
    drv.iteration_time(plan, base)
    assert gst.owed_s == 0.0  # nothing runs on g0 yet: free
    lane.add("x", [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    before = gst.charged_s
    drv.iteration_time(plan, base)
    owed = gst.owed_s
    assert owed > 0 and owed == pytest.approx(min(MAX_OWED_S, gst.charged_s - before))
    lplan = lane._plan()
    lbase = lane.predicted_s(lplan)
    t = lane.time_hook(lplan, lbase)
    assert t == pytest.approx(lbase + min(owed, lbase))  # share 0.5: at most 1× the iteration
    assert gst.owed_s == pytest.approx(owed - (t - lbase))
    assert not geng.has_work()  # the own tenant had nothing: the lane's work alone made the charge owed


def test_a_guest_whose_driver_runs_elsewhere_is_stretched_by_the_whole_share():
    from services.worker.emulated_leases import EmulatedPeers

    now = [1000.0]
    peers = EmulatedPeers()
    gst, geng = _agent("g0", lambda: now[0])
    gst.peers = peers
    peers.add(gst)  # the driver h0 is not in this process
    asyncio.run(gst.on_message(_lease(now[0], 0.5)))
    geng.add("g", [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    gplan = geng._plan()
    gbase = geng.predicted_s(gplan)
    assert gst.iteration_time(gplan, gbase) == pytest.approx(gbase / 0.5)


def test_a_re_sent_grant_extends_an_emulated_lease():
    now = [1000.0]
    drv, deng = _agent("h0", lambda: now[0])
    for i in range(32):
        deng.add(f"r{i}", [5] * 64, SamplingParams(max_tokens=50, ignore_eos=True))
    plan = deng._plan()
    base = deng.predicted_s(plan)
    first = _lease(now[0], 1.0)  # a 10 s window
    asyncio.run(drv.on_message(first))
    now[0] += 15  # past the first window: the lease no longer counts...
    assert drv.iteration_time(plan, base) == base
    asyncio.run(drv.on_message(_extended(first, now[0] + 10)))
    assert drv.iteration_time(plan, base) < base  # ...until the scheduler extends it
    asyncio.run(drv.on_message(LeaseRevoked(msg_id="r", lease_id="L", tenant="a", home_device="h0",
                                            guest_device="g0")))
    asyncio.run(drv.on_message(_extended(first, now[0] + 20)))  # a revoked lease is not revived
    assert drv.iteration_time(plan, base) == base


def _extended(msg: LeaseGranted, end_ts: float) -> LeaseGranted:
    import msgspec
    return msgspec.structs.replace(msg, end_ts=end_ts)


def test_an_idle_same_process_guest_gives_the_driver_all_its_time():
    now = [1000.0]
    peers, drv, deng, gst, geng, plan, base = _same_process_pair(now)
    for a in (drv, gst):
        asyncio.run(a.on_message(_lease(now[0], 0.3)))
    idle = drv.iteration_time(plan, base)  # the guest's tenant is idle: the lease gets the whole guest
    geng.add("g", [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    busy = drv.iteration_time(plan, base)  # now only its share
    assert idle < busy <= base
