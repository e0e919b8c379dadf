"""Guest lanes: the second lease mode (DESIGN §4). Under a ``sequences`` lease, new sequences of another tenant are
placed on this device with their KV here and run whole iterations here, in a guest engine holding that tenant's
full model (staged from its checkpoint or seed). Home work has priority, decided at iteration boundaries by the rule
the simulator's devices follow (``shared/guest_share.py``): no lane iteration while the home tenant has prompts to
prefill, never two in a row while it decodes, and otherwise at most the share of the device its TPOT slack spares
(capped by the leases' ``share``); an idle home leaves the device to the lanes. A revoked or expired lease
stops new placements; sequences already here finish under its share (their KV and results stay valid), as the
simulator's draining leases do. Staged engines stay cached for reuse until a reservation evicts their weights in the
GMG (the device's own tenant or a hand-off needing the memory): :meth:`GuestLanes.drop_evicted`."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import structlog

from shared.config import TenantConfig
from shared.guest_share import LANE_WINDOW_S, MIN_GUEST_SHARE, own_yield
from shared.messages import LeaseGranted, LeaseRevoked

log = structlog.get_logger()

EngineFactory = Callable[[TenantConfig, int], object]  # (tenant, kv_blocks) -> Engine-like


@dataclass
class Lane:
    tenant: str
    engine: object | None = None
    leases: dict[str, LeaseGranted] = field(default_factory=dict)
    draining: dict[str, LeaseGranted] = field(default_factory=dict)  # ended leases whose sequences still run here
    staging: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def accepting(self) -> bool:
        return self.engine is not None and bool(self.leases)

    @property
    def handback(self) -> bool:
        """Whether its sequences go home once prefilled (a lease granted with ``handback``)."""
        return any(getattr(m, "handback", False) for m in (*self.leases.values(), *self.draining.values()))

    def share(self) -> float:
        """The active leases' share; with none, the ended leases' while sequences admitted under them run."""
        active = sum(m.share for m in self.leases.values())
        if active or not self.draining:
            return min(0.95, active)
        return min(0.95, sum(m.share for m in self.draining.values()))


class GuestLanes:
    """Guest engines per tenant on one device, and the home-first time sharing between them and the home."""

    def __init__(self, tenants: dict[str, TenantConfig], factory: EngineFactory, kv_blocks_for: Callable[[TenantConfig], int],
                 window_s: float = LANE_WINDOW_S, tpot_s: float = float("inf")) -> None:
        self.tenants, self.factory, self.kv_blocks_for = tenants, factory, kv_blocks_for
        self.lanes: dict[str, Lane] = {}
        self.window_s = window_s
        self.tpot_s = tpot_s  # the home tenant's TPOT target (the worker sets it): bounds what its steps yield
        self._home_step_s = 0.0  # the home's last iteration
        self._guest_time: deque[tuple[float, float]] = deque()  # (end_ts, seconds) of guest iterations
        self._home_time: deque[tuple[float, float]] = deque()
        self._last_guest = False  # the last iteration next_engine chose was a lane's

    # ------------------------------------------------------------ leases
    def on_granted(self, msg: LeaseGranted) -> Lane | None:
        if msg.tenant not in self.tenants:
            log.warning("lane_unknown_tenant", tenant=msg.tenant, lease_id=msg.lease_id)
            return None
        lane = self.lanes.setdefault(msg.tenant, Lane(msg.tenant))
        lane.leases[msg.lease_id] = msg
        lane.last_used = time.monotonic()
        return lane

    def needs_staging(self, tenant: str) -> bool:
        lane = self.lanes.get(tenant)
        return lane is not None and lane.engine is None and not lane.staging and bool(lane.leases)

    def stage(self, tenant: str) -> None:
        """Build the guest engine (runs on the compute thread: loading weights is device work)."""
        lane = self.lanes[tenant]
        t = self.tenants[tenant]
        t0 = time.perf_counter()
        lane.engine = self.factory(t, self.kv_blocks_for(t))
        log.info("lane_staged", tenant=tenant, seconds=round(time.perf_counter() - t0, 3))

    def on_revoked(self, msg: LeaseRevoked) -> None:
        lane = self.lanes.get(msg.tenant)
        if lane is not None:
            ended = lane.leases.pop(msg.lease_id, None)
            if ended is not None and lane.engine is not None and lane.engine.has_work():
                lane.draining[msg.lease_id] = ended

    def idle_engines(self) -> list[str]:
        """Tenants whose lane engine is built but has no lease, no sequence and is not being staged."""
        return [t for t, ln in self.lanes.items() if ln.engine is not None and not ln.leases and not ln.draining
                and not ln.staging and not ln.engine.has_work()]

    def drop_evicted(self, resident: set[str]) -> list[str]:
        """Drop the idle lane engines (:meth:`idle_engines`) whose weights the GMG no longer lists as resident on
        this device (``tenant|*``): a reservation evicted them as cached weights to fit, so the memory they held is
        promised to something else. The next lease of that tenant here stages them again."""
        out = [t for t in self.idle_engines() if f"{t}|*" not in resident]
        for t in out:
            self.lanes[t].engine = None
        return out

    # ------------------------------------------------------------ requests
    def engine_for(self, tenant: str):
        lane = self.lanes.get(tenant)
        return lane.engine if lane is not None and lane.accepting else None

    def hands_back(self, engine) -> bool:
        """Whether ``engine`` is a lane's whose sequences go home once prefilled."""
        return any(lane.engine is engine and lane.handback for lane in self.lanes.values())

    def owner_of(self, request_id: str):
        for lane in self.lanes.values():
            e = lane.engine
            if e is not None and (request_id in e.running_ids() or request_id in e.waiting_ids()):
                return e
        return None

    # ------------------------------------------------------------ time sharing
    def _trim(self, now: float) -> None:
        for q in (self._guest_time, self._home_time):
            while q and q[0][0] < now - self.window_s:
                q.popleft()

    def record(self, guest: bool, start: float, end: float) -> None:
        (self._guest_time if guest else self._home_time).append((end, end - start))
        if not guest:
            self._home_step_s = end - start

    @staticmethod
    def _prefilling(home) -> bool:
        """The home engine has prompt tokens waiting or being prefilled."""
        backlog = getattr(home, "prefill_backlog", None)
        return backlog is not None and backlog()[0] > 0

    def yield_share(self, home) -> float:
        """Share of the device the lanes get while the home tenant has work (``shared/guest_share.py``): none while
        it has prompts to prefill, else what its last iteration's slack against its TPOT target spares, within the
        leases' shares. What a heartbeat reports as ``guest_share`` (the policy's ``guest_yield``)."""
        if self._prefilling(home):
            return 0.0
        return own_yield(self.share(), self._home_step_s, self.tpot_s)

    def next_engine(self, home) -> object | None:
        """Which engine runs the next iteration: the home unless a lane is owed time (home-first: none while the
        home has prompts to prefill, at most what its TPOT slack yields), and never two lane iterations in a row
        while the home has work (a run of them would stall its tokens)."""
        eng = self._choose(home)
        self._last_guest = eng is not None and eng is not home
        return eng

    def _choose(self, home) -> object | None:
        busy = []
        for lane in self.lanes.values():
            if lane.engine is not None and lane.engine.has_work():
                busy.append(lane)
            elif lane.draining:
                lane.draining.clear()  # its sequences are done
        if not busy:
            return home if home.has_work() else None
        lane = min(busy, key=lambda x: x.last_used)
        if not home.has_work():
            lane.last_used = time.monotonic()
            return lane.engine
        if self._last_guest or self._prefilling(home):
            return home  # its tokens (TPOT) and its prompts (TTFT) first
        now = time.time()
        self._trim(now)
        g = sum(s for _, s in self._guest_time)
        h = sum(s for _, s in self._home_time)
        if g <= max(MIN_GUEST_SHARE, own_yield(self.share(), self._home_step_s, self.tpot_s)) * (g + h):
            lane.last_used = time.monotonic()
            return lane.engine
        return home

    def status(self) -> list[tuple[str, int, int, bool]]:
        out = []
        for lane in self.lanes.values():
            e = lane.engine
            if e is None:
                out.append((lane.tenant, 0, 0, False))
                continue
            out.append((lane.tenant, len(e.running_ids()) + len(e.waiting_ids()), e.prefill_backlog()[0],
                        lane.accepting))
        return out

    def share(self) -> float:
        return min(0.95, sum(lane.share() for lane in self.lanes.values()))

    def accepting(self) -> frozenset[str]:
        """Tenants whose lane takes new sequences now (what a heartbeat's ``guest_lanes`` says)."""
        return frozenset(t for t, lane in self.lanes.items() if lane.accepting)

    def has_work(self) -> bool:
        return any(lane.engine is not None and lane.engine.has_work() for lane in self.lanes.values())
