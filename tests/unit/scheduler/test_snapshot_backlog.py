"""What the live scheduler's snapshot says a device has queued: its own queue plus the worker's backlog (the
worker's last heartbeat and what was placed there since), and the cluster file's policy parameters."""
from __future__ import annotations

import math

import pytest

from services.scheduler.core import DeviceView, SchedulerCore
from services.scheduler.policy_bridge import SnapshotBuilder
from services.scheduler.policy import load_live_policy
from shared.messages import InferenceRequest
from shared.config import ConfigError, REPO_CONFIGS, load_cluster, load_tenants, parse_cluster


def test_device_view_backlog_is_the_heartbeat_plus_later_placements():
    v = DeviceView("d0", True, 1000, 0)
    assert v.backlog() == (0, 0, math.inf)
    v.placed_since += [(10.0, 100, 9.5), (12.0, 50, 11.9)]
    v.on_heartbeat(11.0, queued=3, prefill_tokens=400, oldest_ts=8.0)  # it had seen the first placement
    assert v.backlog() == (4, 450, 8.0)
    v.on_heartbeat(13.0, queued=0, prefill_tokens=0, oldest_ts=0.0)
    assert v.backlog() == (0, 0, math.inf)


def test_guest_lane_backlog_is_the_heartbeat_plus_later_placements():
    v = DeviceView("d0", True, 1000, 0)
    v.guest_lanes = [("t1", 2, 300, True)]
    v.lane_placed_since += [(10.0, "t1", 100), (12.0, "t1", 50), (12.5, "t9", 70)]  # t9: no lane here (ignored)
    assert v.lanes() == {"t1": (4, 450, True)}
    v.on_heartbeat(11.0, queued=0, prefill_tokens=0, oldest_ts=0.0)  # it had seen the first placement
    v.guest_lanes = [("t1", 3, 380, True)]
    assert v.lanes() == {"t1": (4, 430, True)}


def test_snapshot_counts_the_workers_backlog():
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)
    core = SchedulerCore(cluster, tenants, load_live_policy("container"))
    views = {d.id: DeviceView(d.id, True, 10**9, 0) for d in cluster.devices}
    views["cpu0"].on_heartbeat(100.0, queued=5, prefill_tokens=900, oldest_ts=97.0)
    guest = next(t.name for t in tenants.tenants if "cpu1" not in t.home_devices)
    views["cpu1"].guest_lanes = [(guest, 0, 0, True)]
    views["cpu1"].lane_placed_since.append((100.5, guest, 120))
    snap = SnapshotBuilder(cluster, tenants, core).build(101.0, views, {}, {}, {})
    assert snap.devices["cpu1"].guest_engines == {guest: (1, 120, True)}
    d0, d1 = snap.devices["cpu0"], snap.devices["cpu1"]
    assert (d0.queued, d0.queued_prefill_tokens, d0.oldest_pending_s) == (5, 900, 97.0)
    assert (d1.queued, d1.queued_prefill_tokens) == (0, 0) and math.isinf(d1.oldest_pending_s)


def test_the_request_being_routed_is_not_in_its_homes_queues():
    """The simulator routes an arrival before it queues on a device: the live snapshot a request is routed on
    leaves it out of its homes' queued prompts (their tenant's own count keeps it), and only while it is routed."""
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)
    core = SchedulerCore(cluster, tenants, load_live_policy("container"))
    t = tenants.tenants[0]
    for i, n in enumerate((300, 120)):
        req = InferenceRequest(msg_id=f"m{i}", request_id=f"r{i}", tenant=t.name, gateway="g", prompt_ids=[1] * n,
                               max_tokens=8)
        core.queues.push(core.pending_for(req, "0-0", 90.0 + i))
    views = {d.id: DeviceView(d.id, True, 10**9, 0) for d in cluster.devices}
    builder, home, n_home = SnapshotBuilder(cluster, tenants, core), t.home_devices[0], len(t.home_devices)

    def queued(routing):
        snap = builder.build(100.0, views, {}, {}, {}, routing)
        d = snap.devices[home]
        return d.queued, d.queued_prefill_tokens, d.oldest_pending_s, snap.tenants[t.name].queued

    assert queued(None) == (2 // n_home, 420 // n_home, 90.0, 2)
    assert queued((t.name, "r0")) == (1 // n_home, 120 // n_home, 91.0, 2)
    assert queued((t.name, "r1")) == (1 // n_home, 300 // n_home, 90.0, 2)
    other = next(x.name for x in tenants.tenants if x.name != t.name)
    assert queued((other, "r0")) == queued(None)  # another tenant's request: this one's queue is whole


def test_cluster_policy_parameters_and_their_override():
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    base = cluster.policy_params.get("slice")
    # the CPU default leases whole sequences only, each for 5 s (a CPU segment RPC costs milliseconds), and its
    # lanes keep their sequences (no hand-off)
    assert base == {"segments": False, "sequence_lease_s": 5.0, "lane_handback": False}
    assert load_live_policy("slice", "", base).config.segments is False
    assert load_live_policy("slice", "", base).config.lane_handback is False
    assert load_live_policy("slice", '{"lane_handback": true}', base).config.lane_handback is True
    assert load_live_policy("slice", "", base).config.sequence_lease_s == 5.0
    assert load_live_policy("slice", '{"sequence_lease_s": 2.0}', base).config.sequence_lease_s == 2.0
    assert load_live_policy("slice", '{"segments": true}', base).config.segments is True
    with pytest.raises(ValueError, match="not valid JSON"):
        load_live_policy("slice", "{segments", base)
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        load_live_policy("slice", '{"nope": 1}', base)
    with pytest.raises(ConfigError, match="policies.slice"):
        parse_cluster({"devices": [{"id": "c", "backend": "cpu", "memory_gb": 1}], "policies": {"slice": 3}}, "x.yaml")


def test_a_guests_lane_requests_are_not_its_own_tenants_batch():
    """The simulator's snapshot counts a device's own tenant's requests in ``running`` and ``decode_kv_tokens`` and
    its lanes' in ``guest_engines``; the live one does the same with the assigned table's per-home counts."""
    from services.scheduler.core import AssignedTable
    from shared.messages import InferenceRequest
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)
    core = SchedulerCore(cluster, tenants, load_live_policy("container"))
    home_of = {d: t.name for t in tenants.tenants for d in t.home_devices}
    own, guest = home_of["cpu1"], next(t.name for t in tenants.tenants if "cpu1" not in t.home_devices)
    assigned = AssignedTable(home_of)

    def req(rid: str, tenant: str) -> InferenceRequest:
        return InferenceRequest(msg_id=rid, request_id=rid, tenant=tenant, gateway="g", prompt_ids=[1] * 100,
                                max_tokens=20)

    assigned["a"] = ("cpu1", req("a", guest), "w")  # a lane request on cpu1
    views = {d.id: DeviceView(d.id, True, 10**9, 0) for d in cluster.devices}
    for did, v in views.items():
        v.assigned = assigned.per_device.get(did, 0)
    snap = SnapshotBuilder(cluster, tenants, core).build(101.0, views, {}, assigned, {})
    d1 = snap.devices["cpu1"]
    assert (d1.running, d1.decode_kv_tokens, bool(d1.busy)) == (0, 0, False)
    assigned["b"] = ("cpu1", req("b", own), "w")  # one of its own
    snap = SnapshotBuilder(cluster, tenants, core).build(102.0, views, {}, assigned, {})
    d1 = snap.devices["cpu1"]
    assert (d1.running, d1.decode_kv_tokens) == (1, 110) and d1.busy
