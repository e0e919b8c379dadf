"""Device busy-time timelines from decoded stream entries (no Redis): own/guest work, lease windows, clipping."""
from __future__ import annotations

import pytest

from shared.messages import LeaseGranted, LeaseRevoked, RequestStarted, SegmentStat, StepReport, WorkerHeartbeat
from bench.results.timeline import TimelineRecorder, _entry_ts, build_timeline

T0 = 1_700_000_000.0


def report(device, tenant, ws, we, busy=(), guest=(), segs=()):
    return StepReport(msg_id=f"{device}-{ws}", device=device, tenant=tenant, window_start_ts=T0 + ws,
                      window_end_ts=T0 + we, steps=len(busy), busy_ms=1.0,
                      busy_intervals=[(T0 + a, T0 + b) for a, b in busy],
                      guest_intervals=[(tn, T0 + a, T0 + b) for tn, a, b in guest],
                      segments=[SegmentStat(name, 16, 1, ms) for name, ms in segs])


def grant(lid, start, end, guest="d1", home="d0", tenant="a"):
    return LeaseGranted(msg_id=f"g{lid}{end}", lease_id=lid, tenant=tenant, home_device=home, guest_device=guest,
                        segments=["mlp[0]"], start_ts=T0 + start, end_ts=T0 + end)


def test_own_guest_and_segments_are_split_by_source():
    events = [(T0, report("d0", "a", 0.0, 0.5, busy=[(0.1, 0.2), (0.3, 0.45)])),
              (T0, report("d1", "b", 0.0, 0.5, busy=[(0.05, 0.1)], guest=[("a", 0.2, 0.3)],
                          segs=[("a/mlp[0]", 40.0), ("a/mlp[1]", 10.0), ("iteration", 99.0)])),
              (T0, WorkerHeartbeat(msg_id="h", device="d0", worker_id="w", backend="cpu", home_tenant="a", ts=T0)),
              (T0, WorkerHeartbeat(msg_id="i", device="d2", worker_id="w", backend="cpu", home_tenant="c", ts=T0)),
              (T0, RequestStarted(msg_id="r", request_id="x", tenant="a", device="d0", ts=T0))]
    tl = build_timeline(events, [], t0=T0)
    assert tl["devices"] == {"d0": "a", "d1": "b", "d2": "c"}  # d2 was idle: known from its heartbeat
    assert tl["own"] == [["d0", 0.1, 0.2, "a"], ["d0", 0.3, 0.45, "a"], ["d1", 0.05, 0.1, "b"]]
    assert tl["guest"] == [["d1", 0.2, 0.3, "a"]]
    assert tl["guest_segments"] == [["d1", 0.0, 0.5, "a", 50.0]]  # home segments ("iteration") are not guest work
    assert tl["busy"]["d0"]["own_s"] == pytest.approx(0.25)
    assert tl["busy"]["d1"]["guest_s"] == pytest.approx(0.1 + 0.05)
    assert tl["busy"]["d2"] == {"own_s": 0.0, "guest_s": 0.0, "lease_window_s": 0.0, "leases": 0}


def test_lease_windows_follow_extensions_and_revocations():
    worker = [(T0 + 0.0, grant("L1", 1.0, 3.0)), (T0 + 0.0, grant("L1", 1.0, 3.0)),  # sent to guest and home
              (T0 + 2.5, grant("L1", 1.0, 5.0)),  # extended
              (T0 + 4.0, LeaseRevoked(msg_id="r", lease_id="L1", tenant="a", home_device="d0", guest_device="d1",
                                      reason="home_burst")),
              (T0 + 1.0, grant("L2", 6.0, 8.0, guest="d2", tenant="c"))]
    tl = build_timeline([], worker, t0=T0)
    assert sorted(tl["leases"]) == [["d1", "d0", "a", 1.0, 4.0, "segments", "home_burst"],
                                    ["d2", "d0", "c", 6.0, 8.0, "segments", "window"]]
    assert tl["busy"]["d1"]["lease_window_s"] == pytest.approx(3.0) and tl["busy"]["d1"]["leases"] == 1
    assert set(tl["devices"]) == {"d1", "d2"}


def test_clipping_to_the_measured_window():
    events = [(T0, report("d0", "a", 0.0, 10.0, busy=[(0.5, 1.5), (2.0, 3.0), (8.0, 9.5)]))]
    tl = build_timeline(events, [(T0, grant("L", 0.0, 20.0, guest="d0"))], t0=T0 + 1.0, t1=T0 + 9.0)
    assert tl["own"] == [["d0", 0.0, 0.5, "a"], ["d0", 1.0, 2.0, "a"], ["d0", 7.0, 8.0, "a"]]
    assert tl["leases"][0][3:5] == [0.0, 8.0]
    assert tl["t0_ts"] == T0 + 1.0


def test_default_origin_is_the_earliest_interval():
    events = [(T0, report("d0", "a", 5.0, 6.0, busy=[(5.2, 5.4)]))]
    assert build_timeline(events, [])["own"] == [["d0", 0.0, 0.2, "a"]]


def test_entry_ids_give_epoch_seconds():
    assert _entry_ts(b"1700000000123-4") == pytest.approx(1_700_000_000.123)
    assert _entry_ts("5-0") == 0.005


def test_recorder_picks_the_requested_scale_else_the_lightest():
    rec = TimelineRecorder(("slice",))
    rec.points = {("slice", 1.0): {"scale": 1.0}, ("slice", 2.0): {"scale": 2.0}, ("container", 4.0): {"scale": 4.0}}
    assert rec.pick("slice", 2.0000001)["scale"] == 2.0
    assert rec.pick("slice", 3.0)["scale"] == 1.0
    assert rec.pick("slice", None)["scale"] == 1.0
    assert rec.pick("muxserve", 1.0) is None

    class Launcher:  # policies not recorded never touch Redis
        redis_url = "redis://127.0.0.1:1"
    rec.started(Launcher(), "container", 1.0)
    rec.finished(Launcher(), "container", 1.0, {})
    assert ("container", 1.0) not in rec.points


def test_busiest_point_within_the_bound_is_the_one_shown():
    rec = TimelineRecorder(("slice",))
    lease = ["d1", "d0", "a", 0.0, 1.0, "segments", "window"]
    rec.points = {("slice", 1.0): {"scale": 1.0, "violation_rate": 0.0, "leases": []},
                  ("slice", 2.0): {"scale": 2.0, "violation_rate": 0.05, "leases": [lease]},
                  ("slice", 3.0): {"scale": 3.0, "violation_rate": 0.04, "leases": []},
                  ("slice", 4.0): {"scale": 4.0, "violation_rate": 0.5, "leases": [lease, lease]}}
    assert rec.pick_busiest("slice")["scale"] == 2.0
    rec.points[("slice", 2.0)]["leases"] = []
    assert rec.pick_busiest("slice")["scale"] == 3.0  # no leases anywhere within the bound: the highest scale
    for tl in rec.points.values():
        tl["violation_rate"] = 0.2
    assert rec.pick_busiest("slice")["scale"] == 1.0 and rec.pick_busiest("container") is None
