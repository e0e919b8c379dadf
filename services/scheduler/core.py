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


_UNSET = object()
# the DeviceView fields the scheduler's snapshot is built from (services/scheduler/policy_bridge.py)
SNAPSHOT_FIELDS = frozenset({"up", "assigned", "guest_lanes", "guest_share", "worker_queued", "prefill_tokens",
                             "prefill_oldest_ts", "placed_since", "lane_placed_since"})


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
    # bumped whenever a field the scheduler's snapshot reads changes value (see SNAPSHOT_FIELDS); appending to
    # one of the lists in place must bump it too (touch())
    version: int = 0

    def __setattr__(self, name: str, value) -> None:
        if name in SNAPSHOT_FIELDS and getattr(self, name, _UNSET) != value:
            self.touch()
        object.__setattr__(self, name, value)

    def touch(self) -> None:
        """A field the snapshot reads changed (a list in place, say): the snapshot builder must look again."""
        object.__setattr__(self, "version", getattr(self, "version", 0) + 1)
        sink = self.__dict__.get("_sink")  # set by the snapshot builder: the devices to look at next build
        if sink is not None:
            sink.add(self.id)

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


class AssignedTable(dict):
    """``request id -> (device, request, worker id)`` of the requests placed and not finished, with running
    aggregates (per device: how many and their context estimate; per tenant: how many) kept on every change,
    so that a snapshot or a device refresh does not scan every placement."""

    def __init__(self, home_of: dict[str, str] | None = None) -> None:
        super().__init__()
        self.per_device: dict[str, int] = {}
        self.ctx: dict[str, int] = {}  # device -> sum of prompt + max_tokens // 2 (decode context estimate)
        self.per_tenant: dict[str, int] = {}
        # with ``home_of`` (device -> home tenant): the same two per device for its home tenant's requests only (a
        # guest's lane requests are not its own tenant's batch; the simulator's snapshot counts them apart too)
        self.home_of = home_of
        self.own: dict[str, int] = {}
        self.own_ctx: dict[str, int] = {}
        self.changed: set[str] = set()  # devices whose aggregates changed (the snapshot builder clears it)

    def _add(self, a: tuple, k: int) -> None:
        dev, req = a[0], a[1]
        self.changed.add(dev)
        ctx = len(req.prompt_ids) + req.max_tokens // 2
        self.per_device[dev] = self.per_device.get(dev, 0) + k
        self.ctx[dev] = self.ctx.get(dev, 0) + k * ctx
        self.per_tenant[req.tenant] = self.per_tenant.get(req.tenant, 0) + k
        if self.home_of is not None and self.home_of.get(dev) == req.tenant:
            self.own[dev] = self.own.get(dev, 0) + k
            self.own_ctx[dev] = self.own_ctx.get(dev, 0) + k * ctx

    def __setitem__(self, rid: str, a: tuple) -> None:
        old = self.get(rid)
        if old is not None:
            self._add(old, -1)
        super().__setitem__(rid, a)
        self._add(a, 1)

    def __delitem__(self, rid: str) -> None:
        self._add(self[rid], -1)
        super().__delitem__(rid)

    def pop(self, rid: str, *default):
        if rid in self:
            a = super().pop(rid)
            self._add(a, -1)
            return a
        return super().pop(rid, *default)

    def clear(self) -> None:
        self.changed.update(self.per_device)
        super().clear()
        self.per_device.clear()
        self.ctx.clear()
        self.per_tenant.clear()

    def popitem(self):
        raise NotImplementedError("AssignedTable: pop by request id")

    def setdefault(self, rid, default=None):
        raise NotImplementedError("AssignedTable: assign with []=")

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


@dataclass
class TenantQueues:
    """Bounded FIFO per tenant; removal by request id for cancels."""

    bounds: dict[str, int]
    queues: dict[str, OrderedDict[str, Pending]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # per tenant, bumped on every push and pop

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
        self.versions[p.req.tenant] = self.versions.get(p.req.tenant, 0) + 1
        return True

    def head(self, tenant: str) -> Pending | None:
        q = self.queues[tenant]
        return next(iter(q.values()), None)

    def pop(self, tenant: str, request_id: str) -> Pending | None:
        p = self.queues[tenant].pop(request_id, None)
        if p is not None:
            self.versions[tenant] = self.versions.get(tenant, 0) + 1
        return p

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
