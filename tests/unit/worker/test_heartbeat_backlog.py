"""A worker's heartbeat counts the requests assigned to it that its engine has not taken yet (they wait in
``pending_ops`` while a step runs): the scheduler forgets its own placements older than a heartbeat, so a heartbeat
that left them out made a device in a long step look empty to the routing."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from services.worker.service import WorkerService


class _Metric:
    def labels(self, *a):
        return self

    def set(self, v):
        pass


class _Engine:
    kv_blocks_total, kv_blocks_free, kv_bytes_per_block, weight_bytes = 10, 10, 1, 0

    def prefill_backlog(self):
        return 100, []  # 100 prompt tokens of a sequence already in the engine

    def running_ids(self):
        return ["r0"]

    def waiting_ids(self):
        return []


def _assign(rid: str, tenant: str, n: int, arrival: float):
    return ("add", SimpleNamespace(request=SimpleNamespace(request_id=rid, tenant=tenant, prompt_ids=[1] * n,
                                                          arrival_ts=arrival)))


class _Lanes:
    def accepting(self):
        return frozenset({"tb"})

    def status(self):
        return [("tb", 1, 50, True)]

    def yield_share(self, home):
        return 0.5


@pytest.mark.asyncio
async def test_the_heartbeat_counts_requests_waiting_for_the_engine():
    sent = []

    class _Producer:
        async def add_many(self, items, maxlen=None):
            sent.extend(m for _, m in items)

    w = SimpleNamespace(
        engine=_Engine(), tracker=SimpleNamespace(items={}), _agg_lock=threading.Lock(), _busy_s=0.0, _busy_mark=0.0,
        pending_ops=[_assign("r1", "ta", 256, 5.0), _assign("r2", "ta", 64, 7.0), _assign("r3", "tb", 30, 6.0),
                     ("cancel", SimpleNamespace(request_id="r9"))],
        tenant=SimpleNamespace(name="ta"), device=SimpleNamespace(id="d0", backend="cpu", memory_bytes=100),
        worker_id="w", shell=SimpleNamespace(stop=asyncio.Event()), lanes=_Lanes(), lease_agent=None,
        agg=SimpleNamespace(flush=lambda kv: None), producer=_Producer(), p="t:", m_busy=_Metric(), m_mem=_Metric())
    w._pending_adds = lambda: WorkerService._pending_adds(w)
    w._lane_status = lambda pending=None: WorkerService._lane_status(w, pending)
    await WorkerService._heartbeat(w)
    hb = sent[0]
    assert hb.queued == 2 and hb.queued_prefill_tokens == 100 + 256 + 64
    assert hb.prefill_oldest_ts == 5.0
    assert list(hb.guest_lanes[0]) == ["tb", 2, 80, True]  # the lane's own backlog and the request assigned to it
    assert w._prefill_reported == {None: 100 + 256 + 64, "tb": 80}  # what the halving check compares against


class _Drained(_Engine):
    def __init__(self, left: int) -> None:
        self.left = left

    def prefill_backlog(self):
        return self.left, []

    def has_work(self):
        return True


def _drain_worker(reported: int, left: int, pending: list, lane_reported: int = 0, lane_left: int = 0):
    lane = SimpleNamespace(engine=_Drained(lane_left))
    w = SimpleNamespace(engine=_Drained(left), _prefill_reported={None: reported, "tb": lane_reported},
                        pending_ops=pending, tenant=SimpleNamespace(name="ta"), lanes=SimpleNamespace(lanes={"tb": lane}))
    w._lane_tenant = lambda eng: WorkerService._lane_tenant(w, eng)
    w._pending_adds = lambda: WorkerService._pending_adds(w)
    w._backlog_halved = lambda eng=None: WorkerService._backlog_halved(w, w.engine if eng is None else eng)
    return w


def test_a_drained_backlog_asks_for_a_heartbeat_once():
    w = _drain_worker(300, 0, [])
    assert w._backlog_halved() and not w._backlog_halved()  # once per heartbeat; the next one re-arms it


@pytest.mark.parametrize("reported,left,pending", [
    (0, 0, []),  # the last heartbeat already said no backlog
    (300, 151, []),  # more than half the prompt tokens still to prefill
    (300, 100, [_assign("r1", "ta", 64, 1.0)]),  # with a home request waiting for the engine, more than half
])
def test_no_early_heartbeat_while_most_of_the_reported_backlog_holds(reported, left, pending):
    assert not _drain_worker(reported, left, pending)._backlog_halved()


@pytest.mark.parametrize("left", [0, 100, 150])
def test_a_halved_backlog_asks_for_a_heartbeat(left):
    assert _drain_worker(300, left, [])._backlog_halved()


def test_a_lane_request_waiting_does_not_hold_the_home_backlog():
    assert _drain_worker(300, 0, [_assign("r3", "tb", 30, 6.0)])._backlog_halved()


def test_a_lane_backlog_is_checked_against_what_was_reported_for_that_lane():
    w = _drain_worker(300, 300, [_assign("r3", "tb", 30, 6.0)], lane_reported=512, lane_left=256)
    lane = w.lanes.lanes["tb"].engine
    assert not w._backlog_halved(lane)  # 256 left and 30 assigned: more than half of 512
    w.pending_ops = []
    assert w._backlog_halved(lane) and not w._backlog_halved(lane)
    assert not w._backlog_halved()  # the home's own backlog still holds
    assert not w._backlog_halved(_Drained(0))  # an engine that is no lane of this device


def test_the_burst_sends_the_heartbeat_after_the_step_that_drained_the_backlog():
    calls = []
    w = _drain_worker(300, 0, [])
    w.shell, w.lanes, w.publish_q = SimpleNamespace(stop=asyncio.Event()), None, SimpleNamespace(qsize=lambda: 0)
    w._beat_now = SimpleNamespace(set=lambda: None)
    w._step = lambda: SimpleNamespace(events=[], prefill_tokens=300)
    w._publish_direct = lambda events: []
    w._account = lambda *a: None
    loop = SimpleNamespace(call_soon_threadsafe=lambda f, *a: calls.append(f))
    w.pending_ops = [("cancel", SimpleNamespace(request_id="r9"))]  # ends the burst after one step
    WorkerService._burst(w, loop)
    assert calls == [w._beat_now.set]
    w._prefill_reported, calls[:] = {None: 300}, []
    w._step = lambda: SimpleNamespace(events=[], prefill_tokens=0)  # a decode-only step: nothing to check
    WorkerService._burst(w, loop)
    assert calls == []
