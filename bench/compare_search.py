"""The search side of ``bench compare``: the running points' subprocesses, the serial fidelities' turns, and the
bisection of one policy's max sustainable scale on one seed."""
from __future__ import annotations

import argparse
import math
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable


class _Children:
    """The subprocesses of the running comparison's points. On an interrupt (Ctrl-C, SIGTERM, a CI timeout) they
    are terminated and no new point starts, so the comparison stops within seconds instead of carrying every
    policy's search to its end on the pool's threads first."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def run(self, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
        with self._lock:
            if self.stopping.is_set():
                raise RuntimeError("comparison interrupted")
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
            self._live.add(p)
        try:
            out, err = p.communicate()
        finally:
            with self._lock:
                self._live.discard(p)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def stop(self) -> None:
        with self._lock:
            self.stopping.set()
            live = list(self._live)
        for p in live:
            p.terminate()


CHILDREN = _Children()


class _Turns:
    """Round-robin turns for the policies' searches of a serial fidelity: one point at a time, policy after
    policy (container, slice, container, slice, ...), so a drift of the machine's speed over the run reaches every
    policy alike instead of whichever searched during it. A policy whose search has ended leaves the rotation."""

    def __init__(self, policies: list[str]) -> None:
        self.order = list(policies)
        self.turn = 0
        self.cond = threading.Condition()

    def run(self, policy: str, fn: Callable[[], Any]) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.order[self.turn % len(self.order)] == policy)
        try:
            return fn()
        finally:
            with self.cond:
                self.turn = (self.order.index(policy) + 1) % len(self.order)
                self.cond.notify_all()

    def leave(self, policy: str) -> None:
        with self.cond:
            i = self.order.index(policy)
            current = self.order[self.turn % len(self.order)]
            self.order.remove(policy)
            if self.order:
                self.turn = self.order.index(current) if current != policy else i % len(self.order)
            self.cond.notify_all()


def passes(r: dict[str, Any], bound: float) -> bool:
    """A point sustains ``bound``: aggregate violations and every counted tenant's (≥ 100 requests) within it. A
    point that stopped early was stopped because it exceeded the bound it ran for (its partial figures may not show
    it: the tenant may have had fewer than 100 requests by then), so it fails."""
    if r.get("stopped_early"):
        return False
    return r["violation_rate"] <= bound and (r.get("worst_tenant_violation_rate") or 0.0) <= bound


_Answer = tuple[float, "dict[str, Any] | None"]  # a bound's max sustainable scale and its point


class _Search:
    """Points of one policy on one seed, cached by scale, and the two bisections over them.

    A point may stop early once it is known to fail the bound it was run for (``stopped_early``); it then counts as
    failing that bound and every tighter one, and is run again in full if a looser bound asks about it. With
    ``confirm`` > 1 a bound's answer is replayed until it has passed that many times: a point passes only if every
    replay does (its worst violation rate is kept) and its throughput is the replays' mean. A noisy mesh point that
    passed once by luck then fails, and the bisection goes on below it."""

    def __init__(self, policy: str, point: Callable[[float, float], dict[str, Any]], args: argparse.Namespace,
                 confirm: int = 1) -> None:
        self.policy, self.point, self.args = policy, point, args
        self.confirm = max(1, confirm)
        self.cache: dict[float, dict[str, Any]] = {}

    @staticmethod
    def _key(scale: float) -> float:
        return float(f"{scale:.6g}")

    def _known(self, r: dict[str, Any], bound: float) -> bool:
        return not r.get("stopped_early") or bound <= r["stop_above"]

    def at(self, scale: float, bound: float) -> dict[str, Any]:
        scale = self._key(scale)
        r = self.cache.get(scale)
        if r is None or not self._known(r, bound):
            r = self.cache[scale] = dict(self.point(scale, bound), replays=1, stop_above=bound)
        return r

    def ok(self, scale: float, bound: float) -> bool:
        return passes(self.at(scale, bound), bound)

    def again(self, scale: float, bound: float) -> dict[str, Any]:
        """Replay a cached point once more and merge (worst violation rates, mean throughput)."""
        scale = self._key(scale)
        old, r = self.cache[scale], self.point(scale, bound)
        n = old["replays"]
        self.cache[scale] = dict(old, replays=n + 1,
                                 violation_rate=max(old["violation_rate"], r["violation_rate"]),
                                 worst_tenant_violation_rate=max(old.get("worst_tenant_violation_rate") or 0.0,
                                                                 r.get("worst_tenant_violation_rate") or 0.0),
                                 tokens_per_s=(old["tokens_per_s"] * n + r["tokens_per_s"]) / (n + 1))
        return self.cache[scale]

    def boundaries(self, bounds: dict[str, float], passes_max: int = 8) -> dict[str, _Answer]:
        """Each bound's max sustainable scale (by key), the searches repeated until a round adds no point: a point
        that one bound's search ran in full may fail another bound below where that bound's search had ended, and
        its boundary then moves below that failure."""
        out: dict[str, _Answer] = {}
        for _ in range(passes_max):
            seen = self._state()
            out = {key: self.max_scale(bound) for key, bound in bounds.items()}
            if self._state() == seen:
                break
        return out

    def _state(self) -> tuple:
        return tuple(sorted((s, r["replays"], r["stop_above"]) for s, r in self.cache.items()))

    def max_scale(self, bound: float) -> tuple[float, dict[str, Any] | None]:
        while True:
            lo, r = self._bisect(bound)
            if r is None or r["replays"] >= self.confirm:
                return lo, r
            self.again(lo, bound)  # passed fewer times than asked: replay it; a failure sends the bisection below

    def _bisect(self, bound: float) -> tuple[float, dict[str, Any] | None]:
        a = self.args
        known = {s: r for s, r in self.cache.items() if self._known(r, bound)}
        # the first failure bounds the answer: a load above one that fails the bound is not sustainable, even where
        # a short trace's luck lets it pass (the boundary of a 60-s workload need not be monotone)
        hi = min((s for s, r in known.items() if not passes(r, bound)), default=None)
        lo = max((s for s, r in known.items() if passes(r, bound) and (hi is None or s < hi)), default=None)
        s = a.start_scale if lo is None and hi is None else None
        while lo is None or hi is None:
            if s is None:
                s = hi / 2 if lo is None else lo * 2
            if s > a.max_scale or s < 1e-3:
                break
            if self.ok(s, bound):
                lo = s
            else:
                hi = s
            s = None
        if lo is None:
            return 0.0, None
        while hi is not None and hi / lo > 1 + a.tolerance:
            mid = math.sqrt(lo * hi)
            if self.ok(mid, bound):
                lo = mid
            else:
                hi = mid
        return self._key(lo), self.at(lo, bound)
