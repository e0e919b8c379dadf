"""Leases on emulated devices (DESIGN §8): accepted, recorded and reported like on a real worker, with time from
the cost model only (no tensors move; everything here is emulated).

* Driver: while a lease is in its window, an iteration takes the time the simulator's closed form gives for the
  pipelined, offloaded iteration (:func:`shared.costmodel.offload.offloaded_iteration_time`, ``micro_batches`` parts),
  if that is shorter than running alone. The guest gives the lease its ``share`` while its own tenant has work,
  and all that its other leases leave while it is idle (when it is an emulated device of this process; else
  ``share``), as a real guest's :class:`~services.worker.device_lock.DeviceLock` does.
* Guest: it pays for the guest time it actually serves, as a real worker's :class:`DeviceLock` charges it. When
  the driver is an emulated device of the same process (:class:`EmulatedPeers`; the launcher runs every emulated
  device in one process), each offloaded iteration charges the guest the MLP time it ran there; a charge that
  arrives while the guest has no work (its own tenant's or a guest lane's) costs it nothing (the guest ran it in
  idle time), otherwise it is owed and paid by delaying the guest's next iterations, its own and its lanes', by
  :func:`~shared.guest_share.segment_payment` (at most ``share / (1 - share)`` of their length, the rest carried),
  the rule the simulator's devices follow. A lease whose driver runs in another process cannot charge: the
  guest's iterations are stretched as if it took its whole ``share`` (the worst case the scheduler agreed to when
  it granted it).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import structlog

from shared.config import ClusterConfig, DeviceConfig, TenantConfig, TenantsConfig
from shared.costmodel import cost_for, load_profile, transfer_time
from shared.messages import LeaseGranted, LeaseRevoked
from shared.model.engine import StepResult
from shared.costmodel.offload import OffloadPart, OffloadTiming, offloaded_iteration_time
from shared.guest_share import MAX_OWED_S, segment_payment

log = structlog.get_logger(__name__)


@dataclass
class _Lease:
    msg: LeaseGranted
    state: str = "active"  # active | ended

    def live(self, now: float) -> bool:
        return self.state == "active" and self.msg.start_ts - 1.0 <= now < self.msg.end_ts


class EmulatedPeers:
    """The emulated devices of one process, by device id: how a driver reaches the guests it charges."""

    def __init__(self) -> None:
        self.agents: dict[str, "EmulatedLeaseAgent"] = {}

    def add(self, agent: "EmulatedLeaseAgent") -> None:
        self.agents[agent.device.id] = agent

    def remove(self, agent: "EmulatedLeaseAgent") -> None:
        if self.agents.get(agent.device.id) is agent:
            del self.agents[agent.device.id]

    def get(self, device: str) -> "EmulatedLeaseAgent | None":
        return self.agents.get(device)


class EmulatedLeaseAgent:
    """Lease bookkeeping and cost-model timing for an :class:`~services.worker.emulated.EmulatedEngine`."""

    def __init__(self, *, cluster: ClusterConfig, device: DeviceConfig, tenant: TenantConfig,
                 tenants: TenantsConfig, engine, micro_batches: int = 2, clock=time.time,
                 peers: EmulatedPeers | None = None, lanes=None) -> None:
        self.cluster, self.device, self.tenant, self.tenants = cluster, device, tenant, tenants
        self.engine, self.micro_batches, self.clock = engine, micro_batches, clock
        self.peers = peers
        self.driving: dict[str, _Lease] = {}
        self.hosting: dict[str, _Lease] = {}
        self.iterations_leased = 0
        self.saved_s = 0.0
        self.stretched_s = 0.0
        self.owed_s = 0.0  # guest time served to same-process drivers while the own tenant had work, not yet paid
        self.charged_s = 0.0  # all guest time same-process drivers charged (paid, carried, or free in idle time)
        self._lock = threading.Lock()  # charges come from the drivers' compute threads
        engine.time_hook = self.iteration_time
        self.lanes = lanes  # the device's GuestLanes: their iterations pay what is owed too
        if lanes is not None:
            make = lanes.factory

            def lane_engine(t, kv_blocks):
                eng = make(t, kv_blocks)
                eng.time_hook = self.lane_time
                return eng
            lanes.factory = lane_engine
        if peers is not None:
            peers.add(self)

    kv_exports = None  # no tensors: a hand-off's KV costs the link's time (fetch_kv)

    async def start(self) -> None:
        log.info("lease_agent_emulated", device=self.device.id)

    async def fetch_kv(self, device: str, q, msg) -> list:
        """A lane hand-off's KV on emulated devices: no tensors; waits the time the sending device's link takes
        for the sequence's KV (``computed`` positions of the tenant's model), scaled like its iterations."""
        sender = self.cluster.device(device)
        nbytes = msg.computed * self.tenants.get(msg.request.tenant).model.config.kv_bytes_per_token()
        dt = transfer_time(load_profile(sender.kind), self.cluster.link_kind(device, self.device.id), nbytes)
        await asyncio.sleep(dt * getattr(self.engine, "time_scale", 1.0))
        return []

    async def close(self) -> None:
        self.engine.time_hook = None
        if self.peers is not None:
            self.peers.remove(self)

    async def maintain_loop(self, stop) -> None:
        await stop.wait()

    async def on_message(self, msg: LeaseGranted | LeaseRevoked) -> None:
        """Record a lease this device drives or hosts, or its end."""
        me = self.device.id
        if isinstance(msg, LeaseGranted):
            if msg.mode != "segments":
                log.info("lease_mode_not_handled_here", lease_id=msg.lease_id, mode=msg.mode)
                return
            for book, mine in ((self.driving, msg.home_device == me), (self.hosting, msg.guest_device == me)):
                lz = book.get(msg.lease_id)
                if not mine:
                    continue
                if lz is None:
                    book[msg.lease_id] = _Lease(msg)
                elif lz.state == "active":
                    lz.msg = msg  # the same lease re-sent: the scheduler extended its window
            log.info("lease_accepted_emulated", lease_id=msg.lease_id, tenant=msg.tenant,
                     role="driver" if msg.home_device == me else "guest", segments=len(msg.segments))
        else:
            for book in (self.driving, self.hosting):
                lz = book.get(msg.lease_id)
                if lz is not None:
                    lz.state = "ended"
        now = self.clock()
        for book in (self.driving, self.hosting):
            for lid in [k for k, v in book.items() if v.msg.end_ts + 60 < now]:
                del book[lid]

    def step(self) -> StepResult:
        return self.engine.step()

    def drain_segment_stats(self) -> list[tuple[str, int, float]]:
        return []

    # ---------------------------------------------------------------- emulated time
    def iteration_time(self, plan, base_s: float) -> float:
        """The iteration's emulated duration given the leases in their window (called by the engine)."""
        now = self.clock()
        t = base_s
        drv = [lz.msg for lz in self.driving.values() if lz.live(now)]
        if drv:
            timing = self._offloaded(plan, drv)
            if timing is not None and timing[0].total_s < base_s:
                t = timing[0].total_s
                self.iterations_leased += 1
                self.saved_s += base_s - t
                for guest, busy in zip(timing[1], timing[0].guest_busy_s):
                    peer = self.peers.get(guest) if self.peers is not None else None
                    if peer is not None:
                        peer.charge(busy)
        return self._as_guest(t, now)

    def lane_time(self, plan, base_s: float) -> float:
        """A guest lane's iteration here: stretched as the own tenant's are, to pay what drivers are owed."""
        return self._as_guest(base_s, self.clock())

    def _as_guest(self, t: float, now: float) -> float:
        """An iteration ``t`` long on this device, stretched for the segment leases it hosts: by what
        same-process drivers are owed (:func:`segment_payment`), or by the whole share of a lease whose driver
        runs elsewhere."""
        hosted = [lz.msg for lz in self.hosting.values() if lz.live(now)]
        charged = sum(m.share for m in hosted if self._charges(m))
        worst = sum(m.share for m in hosted if not self._charges(m))
        own = t
        if worst > 0:
            t = t / max(0.05, 1.0 - min(worst, 0.95))
        if charged > 0:
            with self._lock:
                pay = segment_payment(self.owed_s, own, charged)
                self.owed_s -= pay
            t += pay
        self.stretched_s += t - own
        return t

    def _guest_share(self, part: OffloadPart) -> float:
        """Share of the guest's time this lease gets now: its ``share`` while the guest's own tenant has work (or
        when the guest is not in this process); with the guest idle, everything its other leases leave (a real
        guest's :class:`DeviceLock` lets guests run freely then; the simulator's ``share_for`` does the same)."""
        peer = self.peers.get(part.guest) if self.peers is not None else None
        if peer is None or peer.engine.has_work():
            return part.share
        now = self.clock()
        others = sum(lz.msg.share for lid, lz in list(peer.hosting.items()) if lid != part.lease_id and lz.live(now))
        return max(part.share, 1.0 - others)

    def _charges(self, msg: LeaseGranted) -> bool:
        """Whether the lease's driver is an emulated device of this process (it charges what it uses)."""
        return self.peers is not None and self.peers.get(msg.home_device) is not None

    def charge(self, seconds: float) -> None:
        """A same-process driver ran ``seconds`` of its segments here: free while the device has no work (its own
        tenant's or a lane's), otherwise owed (paid from its next iterations, at most :data:`MAX_OWED_S` carried)."""
        busy = self.engine.has_work() or (self.lanes is not None and self.lanes.has_work())
        with self._lock:
            self.charged_s += seconds
            if busy:
                self.owed_s = min(MAX_OWED_S, self.owed_s + seconds)

    def _offloaded(self, plan, leases: list[LeaseGranted]) -> tuple[OffloadTiming, list[str]] | None:
        """The offloaded iteration's timing and its parts' guest ids (None when no guest is known)."""
        cfg = self.tenant.model.config
        cost = cost_for(cfg, self.device.kind)
        n_dec = dec_kv = pre = pairs = reads = sampled = 0
        for seq, c in plan:
            if seq.prefilling:
                pre += c.length
                pairs += c.length * c.start + c.length * (c.length + 1) // 2
                reads += c.start + c.length
                sampled += int(c.start + c.length >= len(seq.prompt))
            else:
                n_dec += 1
                dec_kv += c.start + 1
        parts = []
        for m in leases:
            try:
                g = self.cluster.device(m.guest_device)
            except KeyError:
                continue
            link = cost.profile.link(self.cluster.link_kind(self.device.id, g.id))
            parts.append(OffloadPart(g.id, len(m.segments), m.share, link, cost_for(cfg, g.kind), m.lease_id))
        if not parts:
            return None
        timing = offloaded_iteration_time(cost, parts, [self._guest_share(p) for p in parts], n_dec, dec_kv, pre,
                                          pairs, reads, n_dec + sampled, self.micro_batches)
        return timing, [p.guest for p in parts]

    def health_fields(self) -> dict:
        """Lease state for the health hash, labelled emulated."""
        now = self.clock()
        return {
            "leases_driver": ",".join(f"{k}:{'active' if v.live(now) else 'ended'}" for k, v in self.driving.items()),
            "leases_guest": ",".join(f"{k}:{'active' if v.live(now) else 'ended'}" for k, v in self.hosting.items()),
            "leased_iterations": self.iterations_leased, "emulated_saved_ms": round(self.saved_s * 1e3, 1),
            "emulated_guest_stretch_ms": round(self.stretched_s * 1e3, 1),
            "emulated_guest_charged_ms": round(self.charged_s * 1e3, 1), "lease_timing": "emulated",
        }
