"""Leases on emulated devices (DESIGN §8): accepted, recorded and reported like on a real worker, with time from
the cost model only (no tensors move; everything here is emulated).

* Driver: while a lease is in its window, an iteration takes the time the simulator's closed form gives for the
  pipelined, offloaded iteration (:func:`shared.sim.offload.offloaded_iteration_time`, ``micro_batches`` parts,
  the guest giving the lease's ``share``), if that is shorter than running alone.
* Guest: while it hosts leases and its own tenant has work, each of its iterations is stretched as if the
  leases took their whole ``share`` of its time (the worst case the scheduler agreed to when it granted them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from shared.config import ClusterConfig, DeviceConfig, TenantConfig, TenantsConfig
from shared.costmodel import cost_for
from shared.messages import LeaseGranted, LeaseRevoked
from shared.model.engine import StepResult
from shared.sim.offload import OffloadPart, offloaded_iteration_time

log = structlog.get_logger(__name__)


@dataclass
class _Lease:
    msg: LeaseGranted
    state: str = "active"  # active | ended

    def live(self, now: float) -> bool:
        return self.state == "active" and self.msg.start_ts - 1.0 <= now < self.msg.end_ts


class EmulatedLeaseAgent:
    """Lease bookkeeping and cost-model timing for an :class:`~services.worker.emulated.EmulatedEngine`."""

    def __init__(self, *, cluster: ClusterConfig, device: DeviceConfig, tenant: TenantConfig,
                 tenants: TenantsConfig, engine, micro_batches: int = 2, clock=time.time) -> None:
        self.cluster, self.device, self.tenant, self.tenants = cluster, device, tenant, tenants
        self.engine, self.micro_batches, self.clock = engine, micro_batches, clock
        self.driving: dict[str, _Lease] = {}
        self.hosting: dict[str, _Lease] = {}
        self.iterations_leased = 0
        self.saved_s = 0.0
        self.stretched_s = 0.0
        engine.time_hook = self.iteration_time

    async def start(self) -> None:
        log.info("lease_agent_emulated", device=self.device.id)

    async def close(self) -> None:
        self.engine.time_hook = None

    async def maintain_loop(self, stop) -> None:
        await stop.wait()

    async def on_message(self, msg: LeaseGranted | LeaseRevoked) -> None:
        """Record a lease this device drives or hosts, or its end."""
        me = self.device.id
        if isinstance(msg, LeaseGranted):
            if msg.mode != "segments":
                log.info("lease_mode_not_handled_here", lease_id=msg.lease_id, mode=msg.mode)
                return
            if msg.home_device == me:
                self.driving.setdefault(msg.lease_id, _Lease(msg))
            if msg.guest_device == me:
                self.hosting.setdefault(msg.lease_id, _Lease(msg))
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
            t = min(t, self._offloaded(plan, drv))
            if t < base_s:
                self.iterations_leased += 1
                self.saved_s += base_s - t
        share = sum(lz.msg.share for lz in self.hosting.values() if lz.live(now))
        if share > 0:
            stretched = t / max(0.05, 1.0 - min(share, 0.95))
            self.stretched_s += stretched - t
            t = stretched
        return t

    def _offloaded(self, plan, leases: list[LeaseGranted]) -> float:
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
            return float("inf")
        timing = offloaded_iteration_time(cost, parts, [p.share for p in parts], n_dec, dec_kv, pre, pairs, reads,
                                          n_dec + sampled, self.micro_batches)
        return timing.total_s

    def health_fields(self) -> dict:
        """Lease state for the health hash, labelled emulated."""
        now = self.clock()
        return {
            "leases_driver": ",".join(f"{k}:{'active' if v.live(now) else 'ended'}" for k, v in self.driving.items()),
            "leases_guest": ",".join(f"{k}:{'active' if v.live(now) else 'ended'}" for k, v in self.hosting.items()),
            "leased_iterations": self.iterations_leased, "emulated_saved_ms": round(self.saved_s * 1e3, 1),
            "emulated_guest_stretch_ms": round(self.stretched_s * 1e3, 1), "lease_timing": "emulated",
        }
