"""A lease inside the simulator: segments of one tenant's batch running on a guest device for a while."""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.costmodel.offload import OffloadPart

if TYPE_CHECKING:
    from shared.sim.device import SimDevice
    from shared.sim.replica import SimReplica

STAGING, ACTIVE, DRAINING, ENDED, REVOKED = "staging", "active", "draining", "ended", "revoked"


class SimLease:
    """Tenant ``engine.tenant`` runs ``segments`` on ``guest_dev`` during [start, end) with ``share`` of its time."""

    __slots__ = ("lid", "engine", "guest_dev", "segments", "part", "share", "start", "end", "state", "act_bytes",
                 "guest_busy_s", "link_bytes", "staged_new_bytes", "active_from", "mode", "lane",
                 "handback", "lane_busy_s")

    def __init__(self, lid: str, engine: "SimReplica", guest_dev: "SimDevice", segments: tuple[str, ...],
                 part: OffloadPart, share: float, start: float, end: float, act_bytes: int) -> None:
        self.lid, self.engine, self.guest_dev, self.segments = lid, engine, guest_dev, segments
        self.part, self.share, self.start, self.end = part, share, start, end
        self.state = STAGING
        self.act_bytes = act_bytes
        self.guest_busy_s = 0.0  # segments: guest time of its offloaded parts
        self.lane_busy_s = 0.0  # sequences: guest time of its lane's iterations
        self.link_bytes = 0.0
        self.staged_new_bytes = 0
        self.active_from = start
        self.mode = "segments"
        self.lane = None  # sequences mode: the guest lane running the tenant's sequences
        self.handback = False  # sequences mode: prefilled sequences go home (GrantLease.handback)

    @property
    def tenant(self) -> str:
        return self.engine.tenant

    def account(self, guest_busy_s: float, link_bytes: float) -> None:
        """One offloaded iteration used ``guest_busy_s`` of the guest and moved ``link_bytes``."""
        self.guest_busy_s += guest_busy_s
        self.link_bytes += link_bytes
        self.guest_dev.guest_busy_s += guest_busy_s
