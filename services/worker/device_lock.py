"""One device, two kinds of work: the home tenant's engine steps and guest segments of other tenants.

:class:`DeviceLock` lets one of them run at a time. Home work comes first: a guest segment starts only when no
home step holds or waits for the device, so home work waits for at most the guest segment already running
(preemption at the next segment boundary). While the home tenant has work, each lease may take at most its
``share`` of the device: a lease earns ``share / (1 - share)`` seconds of credit per second of home compute and
spends it on its segments; with the home idle, guests run freely. Right after a home step ends, a waiting guest
with credit gets the next turn, so a busy home cannot starve a lease it has granted time to.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

CREDIT_CAP_S = 0.05  # a lease cannot bank more than this much guest time while the home is busy
GUEST_TURN_S = 0.002  # after a home step, how long the device is held open for a waiting guest with credit


class DeviceBusy(TimeoutError):
    """A guest could not get the device before its deadline (home work, or the lease's share is used up)."""


@dataclass
class LockStats:
    """What the lock measured (read by the worker's reports and the tests)."""

    home_acquires: int = 0
    home_wait_max_s: float = 0.0  # longest time a home step waited for the device
    home_wait_total_s: float = 0.0
    home_wait_on_guest_max_s: float = 0.0  # longest wait that started while a guest segment held the device
    home_waits_on_guest: int = 0  # home steps that arrived while a guest segment held the device
    yield_lag_max_s: float = 0.0  # longest time from a guest segment ending to the waiting home step starting
    guest_runs: int = 0
    guest_busy_s: float = 0.0
    guest_run_max_s: float = 0.0
    guest_refused: int = 0


class DeviceLock:
    """Home-first mutual exclusion of one device between the home engine and guest segments."""

    def __init__(self, home_busy: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.perf_counter,
                 credit_cap_s: float = CREDIT_CAP_S) -> None:
        self._cv = threading.Condition()
        self._holder: str | None = None  # "home" | "guest"
        self._home_waiting = 0
        self._waiting: dict[str, int] = {}  # lease id -> guest segments waiting for the device
        self._turn_until = 0.0  # a guest with credit may start before a newly arriving home step until then
        self._guest_ends = 0  # guest segments finished so far
        self._last_guest_end = 0.0
        self._credit: dict[str, float] = {}
        self._shares: dict[str, float] = {}
        self.home_busy = home_busy
        self.clock = clock
        self.credit_cap_s = credit_cap_s
        self.stats = LockStats()

    # ---------------------------------------------------------------- leases
    def set_share(self, lease_id: str, share: float) -> None:
        """Register a lease's bound on guest time while the home has work (0 < share ≤ 1)."""
        with self._cv:
            self._shares[lease_id] = min(1.0, max(0.0, share))
            self._credit.setdefault(lease_id, 0.0)

    def drop(self, lease_id: str) -> None:
        with self._cv:
            self._shares.pop(lease_id, None)
            self._credit.pop(lease_id, None)

    # ---------------------------------------------------------------- home
    @contextmanager
    def home(self) -> Iterator[None]:
        """Hold the device for one home step; waits at most for the guest segment that is running."""
        t0 = self.clock()
        with self._cv:
            on_guest = self._holder == "guest" or self._guest_turn()
            ends_seen = self._guest_ends
            self._home_waiting += 1
            try:
                while self._holder is not None or self._guest_turn():
                    self._cv.wait(timeout=None if self._holder is not None else GUEST_TURN_S)
            finally:
                self._home_waiting -= 1
            self._holder = "home"
            t1 = self.clock()
            lag = t1 - self._last_guest_end if on_guest and self._guest_ends > ends_seen else 0.0
        s = self.stats
        s.home_acquires += 1
        s.home_wait_total_s += t1 - t0
        s.home_wait_max_s = max(s.home_wait_max_s, t1 - t0)
        if on_guest:
            s.home_waits_on_guest += 1
            s.yield_lag_max_s = max(s.yield_lag_max_s, lag)
            s.home_wait_on_guest_max_s = max(s.home_wait_on_guest_max_s, t1 - t0)
        try:
            yield
        finally:
            dur = self.clock() - t1
            with self._cv:
                self._holder = None
                for lid, share in self._shares.items():
                    if share >= 1.0:
                        self._credit[lid] = self.credit_cap_s
                    else:
                        gain = dur * share / max(1e-6, 1.0 - share)
                        self._credit[lid] = min(self.credit_cap_s, self._credit.get(lid, 0.0) + gain)
                if any(n and self._credit.get(lid, 0.0) > 0 for lid, n in self._waiting.items()):
                    self._turn_until = self.clock() + GUEST_TURN_S
                self._cv.notify_all()

    # ---------------------------------------------------------------- guest
    def _guest_turn(self) -> bool:
        return self._turn_until > 0 and self.clock() < self._turn_until

    def _guest_may_run(self, lease_id: str | None) -> bool:
        if self._holder is not None:
            return False
        if self._home_waiting and not (lease_id is not None and self._guest_turn()):
            return False
        if lease_id is None or not self.home_busy():
            return True
        return self._credit.get(lease_id, 0.0) > 0.0

    @contextmanager
    def guest(self, lease_id: str | None, deadline: float | None = None) -> Iterator[float]:
        """Hold the device for one guest segment (``lease_id`` None: staging work, not share-bounded).

        Yields the time waited (seconds). ``DeviceBusy`` if the device is not free by ``deadline`` (``clock``).
        """
        t0 = self.clock()
        key = lease_id or ""
        with self._cv:
            self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                while not self._guest_may_run(lease_id):
                    left = None if deadline is None else deadline - self.clock()
                    if left is not None and left <= 0:
                        self.stats.guest_refused += 1
                        raise DeviceBusy("device busy with home work")
                    # credit also returns when the home goes idle, which nobody signals: poll
                    self._cv.wait(timeout=0.005 if left is None else min(left, 0.005))
            finally:
                self._waiting[key] -= 1
            self._holder = "guest"
            self._turn_until = 0.0
            charged = lease_id is not None and self.home_busy()
        t1 = self.clock()
        try:
            yield t1 - t0
        finally:
            dur = self.clock() - t1
            with self._cv:
                self._holder = None
                self._guest_ends += 1
                self._last_guest_end = self.clock()
                if charged and lease_id in self._credit:
                    self._credit[lease_id] -= dur
                s = self.stats
                s.guest_runs += 1
                s.guest_busy_s += dur
                s.guest_run_max_s = max(s.guest_run_max_s, dur)
                self._cv.notify_all()
