"""DeviceLock: home work first, preemption at the next segment boundary, share-bounded guest time."""
from __future__ import annotations

import threading
import time

import pytest

from services.worker.device_lock import DeviceBusy, DeviceLock


def _hold_guest(lock: DeviceLock, lease: str | None, seconds: float, started: threading.Event | None = None):
    with lock.guest(lease):
        if started is not None:
            started.set()
        time.sleep(seconds)


def test_home_waits_for_at_most_the_running_guest_segment():
    lock = DeviceLock()
    lock.set_share("L", 1.0)
    started = threading.Event()
    t = threading.Thread(target=_hold_guest, args=(lock, "L", 0.05, started))
    t.start()
    started.wait(2)
    queued = []  # a second guest segment already waiting must not run before the home step

    def second():
        with lock.guest("L"):
            queued.append(time.perf_counter())

    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.005)
    t0 = time.perf_counter()
    with lock.home():
        waited = time.perf_counter() - t0
        got = time.perf_counter()
        time.sleep(0.02)
    t.join()
    t2.join()
    assert waited < 0.05 + 0.02  # the rest of the running segment, not two segments
    assert queued and queued[0] > got, "a queued guest segment ran before the waiting home step"
    s = lock.stats
    assert s.home_waits_on_guest == 1 and s.home_wait_on_guest_max_s == pytest.approx(waited, abs=1e-3)
    assert s.yield_lag_max_s < 0.02 and s.guest_runs == 2


def test_guest_waits_while_home_holds_and_runs_freely_when_home_idle():
    lock = DeviceLock(home_busy=lambda: False)
    order = []
    with lock.home():
        t = threading.Thread(target=lambda: (_hold_guest(lock, "L", 0.0), order.append("guest")))
        t.start()
        time.sleep(0.02)
        order.append("home")
    t.join()
    assert order == ["home", "guest"]
    for _ in range(5):  # home idle: no share limit
        with lock.guest("L"):
            pass
    assert lock.stats.guest_runs == 6


def test_share_bounds_guest_time_while_home_has_work():
    busy = [True]
    lock = DeviceLock(home_busy=lambda: busy[0])
    lock.set_share("L", 0.25)  # earns 1/3 s of guest time per second of home compute
    with pytest.raises(DeviceBusy):  # no home compute yet: no credit
        with lock.guest("L", deadline=time.perf_counter() + 0.02):
            pass
    with lock.home():
        time.sleep(0.03)  # 10 ms of credit
    with lock.guest("L", deadline=time.perf_counter() + 0.05):
        time.sleep(0.02)  # spends 20 ms: credit now negative
    with pytest.raises(DeviceBusy):
        with lock.guest("L", deadline=time.perf_counter() + 0.02):
            pass
    assert lock.stats.guest_refused == 2
    busy[0] = False  # home idle again: the guest runs without credit
    with lock.guest("L", deadline=time.perf_counter() + 0.05):
        pass


def test_guest_with_credit_gets_a_turn_between_home_steps():
    """A home with back-to-back steps does not starve a lease it owes time to."""
    lock = DeviceLock(home_busy=lambda: True)
    lock.set_share("L", 0.5)
    stop = threading.Event()
    runs = []

    def home_loop():
        while not stop.is_set():
            with lock.home():
                time.sleep(0.005)

    def guest_loop():
        while not stop.is_set():
            try:
                with lock.guest("L", deadline=time.perf_counter() + 0.5):
                    runs.append(time.perf_counter())
                    time.sleep(0.001)
            except DeviceBusy:
                pass

    threads = [threading.Thread(target=home_loop), threading.Thread(target=guest_loop)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert len(runs) >= 5
    s = lock.stats
    assert s.guest_busy_s <= 0.3 * 0.5 + 0.05  # at most about its share


def test_staging_work_never_takes_a_turn_ahead_of_home():
    lock = DeviceLock(home_busy=lambda: True)
    ran = []
    with lock.home():
        t = threading.Thread(target=lambda: (_hold_guest(lock, None, 0.0), ran.append(1)))
        t.start()
        time.sleep(0.01)
        assert not ran
    t.join()
    assert ran == [1]
