"""The scheduler's side of the simulator's steering: follow the versioned ``sim:steering`` copy the simulator
service publishes (its learned cost-model corrections and device forecasts) and apply it to the what-if and to the
snapshots decisions are made on; fall back to the uncorrected cost model when the copy is absent, stale, malformed
or steering is turned off (``SLICESCHED_SIM_STEERING=0``), and say which in logs and metrics.

Nothing here is on the decision path: a poll (one ``HGET`` of the version, an ``HGETALL`` only when it changed)
runs in its own task every ``POLL_S``, and a decision reads what the last poll applied.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

import structlog
from prometheus_client import CollectorRegistry, Gauge

from shared.config import env_number
from shared.messages import sim_steering_key
from shared.policies.snapshot import ClusterSnapshot
from shared.redis_util import REDIS_ERRORS
from shared.sim.steering import STALE_AFTER_S, CorrectedWhatIf, SteeringCopy, steer_snapshot

log = structlog.get_logger()

POLL_S = 0.5


def steering_settings(env=None) -> tuple[bool, float]:
    """(steering on, seconds after which an unchanged copy is stale) from ``SLICESCHED_SIM_STEERING`` (1 or 0)
    and ``SLICESCHED_SIM_STEERING_STALE_S``; a malformed value raises ConfigError naming the variable."""
    on = env_number("SLICESCHED_SIM_STEERING", 1, int, minimum=0, maximum=1, env=env)
    stale = env_number("SLICESCHED_SIM_STEERING_STALE_S", STALE_AFTER_S, float, above=0, env=env)
    return bool(on), stale


class SteeringFollower:
    """Keeps the copy in use (``copy``; None: uncorrected, no forecast) and its state: ``in_use``, ``absent`` (no
    copy published), ``stale`` (unchanged for ``stale_after_s``), ``bad`` (malformed), ``off``, or ``starting``
    (not polled yet)."""

    def __init__(self, redis, prefix: str, whatif: CorrectedWhatIf | None, *, enabled: bool = True,
                 stale_after_s: float = STALE_AFTER_S, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.redis, self.key, self.whatif = redis, sim_steering_key(prefix), whatif
        self.enabled, self.stale_after_s = enabled, stale_after_s
        self.clock, self.wall = clock, wall
        self.copy: SteeringCopy | None = None
        self.state = "starting" if enabled else "off"  # the first poll logs what the what-if starts with
        self._seen: int | None = None  # newest version read
        self._latest: SteeringCopy | None = None  # the copy of that version
        self._seen_at = 0.0  # monotonic time it was first read, less its age then
        self.m_version = Gauge("slicesched_scheduler_sim_steering_version",
                               "Version of the simulator's steering copy the what-if uses (0: none, uncorrected)",
                               registry=registry)
        self.m_age = Gauge("slicesched_scheduler_sim_steering_age_seconds",
                           "Age of the newest steering copy seen (NaN: none seen)", registry=registry)
        self.m_factors = Gauge("slicesched_scheduler_sim_steering_factors",
                               "Correction factors of the copy in use (device kind x segment kind)",
                               registry=registry)
        self.m_age.set(math.nan)

    def age(self) -> float:
        """Seconds since the newest version seen was published (its age when first read, then this process's
        monotonic clock: no dependence on the two hosts' wall clocks agreeing beyond the first read)."""
        return math.nan if self._seen is None else self.clock() - self._seen_at

    async def poll(self) -> str:
        """Read the version; on a change read and apply the copy; drop it once stale. Returns the state."""
        state = await self._poll()
        self.m_age.set(self.age())
        return state

    async def _poll(self) -> str:
        if not self.enabled:
            return self._set("off", None)
        raw = await self.redis.hget(self.key, "version")
        if raw is None:
            self._seen = self._latest = None
            return self._set("absent", None)
        if self._seen is None or _s(raw) != str(self._seen):
            fields = {_s(k): _s(v) for k, v in (await self.redis.hgetall(self.key)).items()}
            try:
                copy = SteeringCopy.from_fields(fields)
            except ValueError as e:
                self._seen = self._latest = None
                return self._set("bad", None, error=str(e))
            if copy.version != self._seen:
                self._seen, self._latest = copy.version, copy
                self._seen_at = self.clock() - max(0.0, self.wall() - copy.ts)
        age = self.age()
        if age > self.stale_after_s:
            return self._set("stale", None, age_s=round(age, 1), version=self._seen)
        return self._set("in_use", self._latest)

    def _set(self, state: str, copy: SteeringCopy | None, **why) -> str:
        if copy is not self.copy:
            self.copy = copy
            if self.whatif is not None:
                self.whatif.set_factors(copy.factors if copy is not None else {})
            n = sum(len(ops) for ops in copy.factors.values()) if copy is not None else 0
            self.m_version.set(copy.version if copy is not None else 0)
            self.m_factors.set(n)
        if state != self.state:
            self.state = state
            if copy is not None:
                log.info("sim_steering_in_use", version=copy.version, age_s=round(self.age(), 2),
                         factors=sum(len(ops) for ops in copy.factors.values()), forecast_devices=len(copy.busy))
            else:  # the what-if is back on the uncorrected cost model, decisions on the scheduler's own view
                log.warning("sim_steering_fallback", reason=state, **why)
        return state

    def steer(self, snap: ClusterSnapshot) -> ClusterSnapshot:
        """The snapshot a decision is made on: the copy's forecast applied (unchanged without a copy in use)."""
        if self.copy is not None:
            steer_snapshot(snap, self.copy)
        return snap

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``POLL_S`` until ``stop``; a Redis error keeps the copy until it turns stale."""
        while not stop.is_set():
            try:
                await self.poll()
            except REDIS_ERRORS as e:
                log.warning("sim_steering_read_error", error=repr(e))
                if self.copy is not None and self.age() > self.stale_after_s:
                    self._set("stale", None, age_s=round(self.age(), 1))
            try:
                await asyncio.wait_for(stop.wait(), timeout=POLL_S)
            except asyncio.TimeoutError:
                pass


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
