"""The live scheduler's incremental snapshot equals one built from scratch after every kind of change (queues,
heartbeats, placements, GMG rows, leases), and the guest index it keeps equals a full ranking."""
from __future__ import annotations

import dataclasses
import random

from services.scheduler.core import AssignedTable, DeviceView, SchedulerCore
from services.scheduler.policy import load_live_policy
from services.scheduler.policy_bridge import SnapshotBuilder
from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.messages import InferenceRequest
from shared.policies.guest_index import GuestIndex, rank_all
from shared.policies.snapshot import LeaseState


def _state(snap):
    devs = {k: dataclasses.asdict(v) for k, v in snap.devices.items()}
    ts = {k: (v.queued, v.running) for k, v in snap.tenants.items()}
    return devs, ts, {k: dataclasses.asdict(v) for k, v in snap.leases.items()}


def test_incremental_snapshot_equals_a_fresh_one_after_random_changes():
    rng = random.Random(7)
    cluster = load_cluster(REPO_CONFIGS / "cluster-h100x32.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-16mix.yaml", cluster)
    core = SchedulerCore(cluster, tenants, load_live_policy("slice"))
    ids = [d.id for d in cluster.devices]
    names = [t.name for t in tenants.tenants]
    views = {d: DeviceView(d, True, 76 << 30, 20 << 30) for d in ids}
    rows = {d: {"limit": str(76 << 30), "reserved": str(20 << 30), "running": "0", "busy_ratio": "0.1",
                "resident": "", "evictable": 0} for d in ids}
    assigned, plain = AssignedTable(), {}
    leases: dict[str, LeaseState] = {}
    inc = SnapshotBuilder(cluster, tenants, core)
    index = None
    now, n = 1000.0, 0
    for step in range(300):
        now += rng.uniform(0.001, 0.05)
        n += 1
        kind = rng.randrange(7)
        t = rng.choice(names)
        if kind == 0:  # a request queues
            req = InferenceRequest(msg_id=f"m{n}", request_id=f"r{n}", tenant=t, gateway="g",
                                   prompt_ids=[1] * rng.randint(1, 3000), max_tokens=rng.randint(1, 300))
            core.queues.push(core.pending_for(req, "0-0", now - rng.random()))
        elif kind == 1 and core.queues.queues[t]:  # one leaves its queue (placed or cancelled)
            core.queues.pop(t, rng.choice(list(core.queues.queues[t])))
        elif kind == 2:  # placed on a device, or one finishes
            d = rng.choice(ids)
            if assigned and rng.random() < 0.4:
                rid = rng.choice(list(assigned))
                assigned.pop(rid)
                plain.pop(rid)
                views[d].assigned = max(0, views[d].assigned - 1)
            else:
                req = InferenceRequest(msg_id=f"m{n}", request_id=f"a{n}", tenant=t, gateway="g",
                                       prompt_ids=[1] * rng.randint(1, 3000), max_tokens=rng.randint(1, 300))
                assigned[req.request_id] = plain[req.request_id] = (d, req, "w")
                views[d].assigned += 1
                views[d].placed_since.append((now, len(req.prompt_ids), now - 0.1))
                views[d].touch()
        elif kind == 3:  # a heartbeat
            v = views[rng.choice(ids)]
            v.on_heartbeat(now - 0.01, rng.randint(0, 5), rng.randint(0, 4000), now - rng.random())
            v.guest_lanes = [(rng.choice(names), rng.randint(0, 4), rng.randint(0, 900), True)] if rng.random() < 0.3 else []
            v.guest_share = rng.choice([0.0, 0.2, 0.4])
        elif kind == 4:  # the GMG rows are refreshed (new objects; some changed)
            rows = {d: dict(r) for d, r in rows.items()}
            for d in rng.sample(ids, 5):
                rows[d]["reserved"] = str(rng.randint(10, 70) << 30)
                rows[d]["running"] = str(rng.randint(0, 40))
                rows[d]["busy_ratio"] = str(rng.random())
                rows[d]["resident"] = ",".join(f"{rng.choice(names)}|{s}" for s in ("*", "mlp[0]") if rng.random() < 0.5)
        elif kind == 5:  # a lease is granted
            home, guest = rng.sample(ids, 2)
            lid = f"L{n}"
            leases[lid] = LeaseState(lid, t, home, guest, ("*",), now, now + 1, 1 << 30, rng.choice([0.1, 0.3]),
                                     mode="sequences", state="active")
        elif kind == 6 and leases:  # one ends
            leases.pop(rng.choice(list(leases)))
        if rng.random() < 0.2:
            views[rng.choice(ids)].up = rng.random() < 0.8
        if rng.random() < 0.3:  # placed on another tenant's guest lane (a list changed in place, nothing else)
            v = views[rng.choice(ids)]
            if v.guest_lanes:
                v.lane_placed_since.append((now, v.guest_lanes[0][0], rng.randint(1, 500)))
                v.touch()
        queued = [(q, rid) for q in names for rid in core.queues.queues[q]]
        routing = rng.choice(queued) if queued and rng.random() < 0.5 else None  # a queued request being routed
        snap = inc.build(now, views, rows, assigned, leases, routing)
        if index is None:
            index = snap.device_index = GuestIndex(snap.devices)
        fresh = SnapshotBuilder(cluster, tenants, core)
        fresh.rates = inc.rates
        assert _state(snap) == _state(fresh.build(now, views, rows, plain, leases, routing)), f"step {step}"
        d = snap.devices[rng.choice(ids)]
        exclude = set(rng.sample(ids, 2))

        def eligible(g):
            return g.id != d.id and g.id not in exclude and not g.draining and g.guest_share < 0.85
        assert index.rank(t, d.host, 16, eligible) == rank_all(snap.devices.values(), t, d.host, 16, eligible)
    assert snap.tracked and snap is inc.build(now, views, rows, assigned, leases)  # one snapshot, updated in place


def test_assigned_table_keeps_its_aggregates():
    t = AssignedTable()
    r1 = InferenceRequest(msg_id="1", request_id="a", tenant="x", gateway="g", prompt_ids=[1] * 10, max_tokens=7)
    r2 = InferenceRequest(msg_id="2", request_id="b", tenant="y", gateway="g", prompt_ids=[1] * 4, max_tokens=2)
    t["a"], t["b"] = ("d0", r1, "w"), ("d0", r2, "w")
    assert t.per_device == {"d0": 2} and t.ctx == {"d0": 10 + 3 + 4 + 1} and t.per_tenant == {"x": 1, "y": 1}
    t["a"] = ("d1", r1, "w")  # moved
    assert t.per_device["d0"] == 1 and t.ctx == {"d0": 5, "d1": 13}
    assert t.pop("b")[1] is r2 and t.pop("zz", None) is None
    del t["a"]
    assert not t and t.per_device == {"d0": 0, "d1": 0} and t.per_tenant == {"x": 0, "y": 0}
