"""Scheduler decisions as plain objects (no Redis): per-tenant bounded queues, KV sizing, device choice."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.config import ClusterConfig, TenantsConfig
from shared.messages import InferenceRequest

KV_BLOCK_SIZE = 16


def kv_blocks_for(prompt_len: int, max_tokens: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """KV blocks reserved for a request up front (prompt + every token it may generate); matches the engine."""
    return math.ceil((prompt_len + max_tokens) / block_size)


@dataclass
class Pending:
    req: InferenceRequest
    entry_id: str
    kv_blocks: int
    kv_bytes: int
    enqueued_ts: float


@dataclass
class DeviceView:
    """What the scheduler knows of one device (refreshed from the GMG)."""

    id: str
    up: bool
    limit: int
    reserved: int
    worker_id: str = ""
    heartbeat_ts: float = 0.0
    running: int = 0
    assigned: int = 0  # requests placed by us and not finished
    guest_lanes: list = field(default_factory=list)  # (tenant, outstanding, queued tokens, accepting) per lane
    guest_share: float = 0.0
    # the worker's home backlog as of its last heartbeat (waiting requests, prompt tokens not yet prefilled, the
    # oldest of those requests' arrival) and what was placed here since: (placed ts, prompt tokens, arrival ts)
    worker_queued: int = 0
    prefill_tokens: int = 0
    prefill_oldest_ts: float = 0.0
    placed_since: list = field(default_factory=list)
    # other tenants' requests placed on this device's guest lanes since its last heartbeat: (ts, tenant, tokens)
    lane_placed_since: list = field(default_factory=list)

    def on_heartbeat(self, ts: float, queued: int, prefill_tokens: int, oldest_ts: float) -> None:
        self.worker_queued, self.prefill_tokens, self.prefill_oldest_ts = queued, prefill_tokens, oldest_ts
        self.placed_since = [x for x in self.placed_since if x[0] > ts]
        self.lane_placed_since = [x for x in self.lane_placed_since if x[0] > ts]

    def lanes(self) -> dict[str, tuple[int, int, bool]]:
        """tenant -> (outstanding, prompt tokens queued, accepting) per guest lane, as of the last heartbeat plus
        what was placed on the lane since (without it, every placement between two heartbeats would see the
        lane as empty and go there)."""
        out = {t: (n, q, acc) for (t, n, q, acc) in self.guest_lanes}
        for _, t, n in self.lane_placed_since:
            if t in out:
                o, q, acc = out[t]
                out[t] = (o + 1, q + n, acc)
        return out

    def backlog(self) -> tuple[int, int, float]:
        """(waiting requests, prompt tokens not yet prefilled, oldest arrival or inf) on the worker, including what
        was placed after its last heartbeat."""
        oldest = [self.prefill_oldest_ts] if self.prefill_oldest_ts > 0 else []
        oldest += [a for _, _, a in self.placed_since if a > 0]
        return (self.worker_queued + len(self.placed_since), self.prefill_tokens + sum(n for _, n, _ in self.placed_since),
                min(oldest, default=float("inf")))

    @property
    def free(self) -> int:
        return self.limit - self.reserved


@dataclass
class TenantQueues:
    """Bounded FIFO per tenant; removal by request id for cancels."""

    bounds: dict[str, int]
    queues: dict[str, OrderedDict[str, Pending]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.bounds:
            self.queues.setdefault(t, OrderedDict())

    def push(self, p: Pending) -> bool:
        q = self.queues[p.req.tenant]
        if p.req.request_id in q:
            return True
        if len(q) >= self.bounds[p.req.tenant]:
            return False
        q[p.req.request_id] = p
        return True

    def head(self, tenant: str) -> Pending | None:
        q = self.queues[tenant]
        return next(iter(q.values()), None)

    def pop(self, tenant: str, request_id: str) -> Pending | None:
        return self.queues[tenant].pop(request_id, None)

    def find(self, request_id: str) -> Pending | None:
        for q in self.queues.values():
            if request_id in q:
                return q[request_id]
        return None

    def depth(self, tenant: str) -> int:
        return len(self.queues[tenant])

    def all(self) -> list[Pending]:
        return [p for q in self.queues.values() for p in q.values()]


class SchedulerCore:
    """Sizing and routing for admissions; the policy object comes from the shared registry."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, policy, block_size: int = KV_BLOCK_SIZE):
        self.cluster, self.tenants, self.policy, self.block_size = cluster, tenants, policy, block_size
        self.kv_bytes_per_block = {t.name: t.model.config.kv_bytes_per_token() * block_size for t in tenants.tenants}
        self.context = {t.name: t.model.config.max_position_embeddings for t in tenants.tenants}
        self.queues = TenantQueues({t.name: t.max_queue for t in tenants.tenants})

    def pending_for(self, req: InferenceRequest, entry_id: str, now: float) -> Pending:
        blocks = kv_blocks_for(len(req.prompt_ids), req.max_tokens, self.block_size)
        return Pending(req, entry_id, blocks, blocks * self.kv_bytes_per_block[req.tenant], now)

    def candidates(self, tenant: str, devices: dict[str, DeviceView], kv_bytes: int) -> list[str]:
        """Devices to try for a request of ``tenant``, best first (the policy decides the order)."""
        return self.policy.route_live(tenant, self.tenants.get(tenant).home_devices, devices, kv_bytes)
