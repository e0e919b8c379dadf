"""GMGCore: events -> mutations, idempotency and staleness, without Redis."""
from __future__ import annotations

from shared.gmg.keys import GMGKeys
from shared.gmg.mutations import apply_mutation
from shared.messages import DeviceDown, StepReport, WorkerHeartbeat
from services.gmg.core import GMGCore

K = GMGKeys("t:")


def _hb(ts: float, worker: str = "w1", **kw) -> WorkerHeartbeat:
    return WorkerHeartbeat(msg_id=f"h{ts}", device="d0", worker_id=worker, backend="cpu", home_tenant="a", ts=ts, **kw)


def _apply(mirror: dict, change) -> None:
    op, b = change
    for cmd, kidx, *args in b.muts:
        apply_mutation(mirror, cmd, b.keys[kidx - 1], list(args))


def test_heartbeat_fields_and_order():
    core, mirror = GMGCore(K, ["d0"]), {}
    _apply(mirror, core.on_event(_hb(10.0, weight_bytes=100, kv_used_bytes=20, running=3), now=10.0))
    dev = mirror[K.device("d0")]
    assert dev["state"] == "ready" and dev["used"] == "120" and dev["running"] == "3"
    assert core.on_event(_hb(9.0), now=10.5) is None  # older heartbeat
    assert core.on_event(_hb(10.0), now=10.5) is None  # duplicate
    assert core.on_event(_hb(11.0), now=11.0) is not None
    unknown = WorkerHeartbeat(msg_id="u", device="zz", worker_id="w", backend="cpu", home_tenant="", ts=1.0)
    assert core.on_event(unknown, now=1.0) is None


def test_sweep_uses_receive_time_and_down_is_idempotent():
    core = GMGCore(K, ["d0"], heartbeat_timeout_s=3.0)
    core.on_event(_hb(1000.0), now=50.0)  # worker clock far ahead of ours: staleness uses our clock
    assert core.sweep(52.9) == []
    [(op, _b)] = core.sweep(53.1)
    assert op == "device_down" and core.devices["d0"].state == "down"
    assert core.sweep(60.0) == []  # already down
    assert core.on_event(DeviceDown(msg_id="x", device="d0", worker_id="w1", reason="r", ts=1.0), now=60) is None


def test_device_down_from_replaced_worker_is_ignored():
    core = GMGCore(K, ["d0"])
    core.on_event(_hb(100.0, worker="w2"), now=100.0)
    assert core.on_event(DeviceDown(msg_id="x", device="d0", worker_id="w1", reason="exit", ts=99.0), now=100) is None
    assert core.on_event(DeviceDown(msg_id="y", device="d0", worker_id="w2", reason="exit", ts=101.0),
                         now=101) is not None


def test_step_reports_accumulate_once_and_trim_busy():
    core, mirror = GMGCore(K, ["d0"], busy_keep_s=1.0), {}
    for end in (10.0, 10.5, 10.5, 12.0):  # the repeated window is a redelivery
        ch = core.on_event(StepReport(msg_id=f"s{end}", device="d0", tenant="a", window_start_ts=end - 0.4,
                                      window_end_ts=end, steps=2, busy_ms=100.0,
                                      busy_intervals=[(end - 0.4, end - 0.1)]), now=end)
        if ch:
            _apply(mirror, ch)
    ex = mirror[K.exec_state("d0")]
    assert ex["steps_total"] == "6" and float(ex["busy_ms_total"]) == 300.0
    assert list(mirror[K.busy("d0")].values()) == [11.9]  # intervals ending before 12.0 - 1.0 were trimmed


def test_a_devices_row_counts_its_requests_as_they_start_move_and_finish():
    from shared.messages import RequestFinished, RequestMoved, RequestStarted
    core, mirror = GMGCore(K, ["d0", "d1"]), {}

    def started(rid: str, dev: str) -> RequestStarted:
        return RequestStarted(msg_id=f"s{rid}", request_id=rid, tenant="a", device=dev, ts=1.0)

    for rid, dev in (("r1", "d0"), ("r2", "d0"), ("r3", "d1")):
        _apply(mirror, core.on_event(started(rid, dev), now=1.0))
    assert mirror[K.device("d0")]["requests"] == "2" and mirror[K.device("d1")]["requests"] == "1"
    assert core.on_event(started("r1", "d0"), now=1.0) is None  # a redelivery counts once
    _apply(mirror, core.on_event(RequestMoved(msg_id="m", request_id="r3", tenant="a", from_device="d1", device="d0",
                                              worker_id="w", kv_blocks=1, ts=2.0), now=2.0))
    assert mirror[K.device("d0")]["requests"] == "3" and mirror[K.device("d1")]["requests"] == "0"
    _apply(mirror, core.on_event(RequestFinished(msg_id="f", request_id="r1", tenant="a", device="d0",
                                                 outcome="stop", prompt_tokens=1, completion_tokens=1, kv_blocks=1,
                                                 ts=3.0), now=3.0))
    assert mirror[K.device("d0")]["requests"] == "2"
