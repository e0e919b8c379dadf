"""The cluster snapshot every policy decides over; built by the simulator (kept current in place) and by the
live scheduler (from Redis state). Plain data: no methods that reach outside the snapshot."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from shared.config import SLA
from shared.model.config import ModelConfig


@dataclass(slots=True)
class DeviceState:
    """One device as the scheduler sees it."""

    id: str
    kind: str
    host: str
    capacity_bytes: int
    headroom_bytes: int
    home_tenant: str | None = None
    tenants: list[str] = field(default_factory=list)  # tenants with an engine (weights resident) here
    used_bytes: int = 0  # all reservations: weights, KV, staged segments, activations
    kv_bytes: int = 0
    staged_bytes: int = 0
    evictable_bytes: int = 0  # staged weights no active lease pins (cached, LRU)
    queued: int = 0  # requests waiting for admission (all engines here)
    running: int = 0  # sequences in the batch
    queued_prefill_tokens: int = 0
    decode_kv_tokens: int = 0  # total context of decoding sequences (drives decode iteration time)
    oldest_pending_s: float = math.inf  # arrival time of the oldest request without its first token
    busy: bool = False
    busy_until_s: float = 0.0
    guest_share: float = 0.0  # fraction of this device's time promised to guests by active leases
    guest_yield: float = 0.0  # fraction guests get right now while its own tenant is active (0 while it prefills)
    resident: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, segment) -> bytes staged
    draining: bool = False
    outstanding_by_tenant: dict[str, int] = field(default_factory=dict)
    guest_engines: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # tenant -> (outstanding,
    #   queued prompt tokens, accepting) of sequences running here under a "sequences" lease

    @property
    def limit_bytes(self) -> int:
        return self.capacity_bytes - self.headroom_bytes

    @property
    def free_bytes(self) -> int:
        """Memory that can be reserved now (evicting cached staged weights would free more)."""
        return self.limit_bytes - self.used_bytes

    @property
    def outstanding(self) -> int:
        return self.queued + self.running


@dataclass(slots=True)
class TenantState:
    """One tenant: model, SLA, home devices, queue and recent behaviour."""

    name: str
    model: ModelConfig
    sla: SLA
    home_devices: list[str]
    queued: int = 0
    running: int = 0
    rate_rps: float = 0.0  # recent arrival rate (EWMA)
    mean_input: float = 0.0
    mean_output: float = 0.0
    slack_s: float = math.inf  # TTFT target minus the worst predicted TTFT among its queued requests
    violation_rate: float = 0.0  # share of its recent requests past their SLA (shared/policies/attainment.py)
    recent_requests: float = 0.0  # how many recent requests that rate is over (decayed count)


@dataclass(slots=True)
class LeaseState:
    """A grant to ``tenant`` to run ``segments`` on ``guest`` during [start_s, end_s) with a share of its time."""

    id: str
    tenant: str
    home_device: str
    guest_device: str
    segments: tuple[str, ...]
    start_s: float
    end_s: float
    memory_bytes: int
    share: float
    mode: str = "segments"  # segments: MLP blocks of the home's batch run on the guest; sequences: whole ones
    state: str = "staging"  # staging | active | ended | revoked
    handback: bool = False  # sequences: prefilled sequences go home (lane hand-off)


class LeaseTable(dict):
    """``lease id -> LeaseState`` that keeps itself indexed by guest device, home device and tenant as leases are
    added and removed (each group in the table's own order), so that the policies look leases up instead of
    scanning them. A lease's own fields (state, end) may change in place; its devices and tenant never do."""

    __slots__ = ("by_guest", "by_home", "by_tenant")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rebuild()

    def _rebuild(self) -> None:
        self.by_guest: dict[str, dict[str, LeaseState]] = {}
        self.by_home: dict[str, dict[str, LeaseState]] = {}
        self.by_tenant: dict[str, dict[str, LeaseState]] = {}
        for lid, lease in self.items():
            self._file(lid, lease)

    def _file(self, lid: str, lease: LeaseState) -> None:
        self.by_guest.setdefault(lease.guest_device, {})[lid] = lease
        self.by_home.setdefault(lease.home_device, {})[lid] = lease
        self.by_tenant.setdefault(lease.tenant, {})[lid] = lease

    def _unfile(self, lid: str, lease: LeaseState) -> None:
        for idx, key in ((self.by_guest, lease.guest_device), (self.by_home, lease.home_device),
                         (self.by_tenant, lease.tenant)):
            group = idx[key]
            del group[lid]
            if not group:
                del idx[key]

    def __setitem__(self, lid: str, lease: LeaseState) -> None:
        replaced = lid in self
        super().__setitem__(lid, lease)
        if replaced:  # it keeps its place in the table: rebuild so that the groups keep the table's order
            self._rebuild()
        else:
            self._file(lid, lease)

    def __delitem__(self, lid: str) -> None:
        lease = self[lid]
        super().__delitem__(lid)
        self._unfile(lid, lease)

    def pop(self, lid: str, *default):
        if lid in self:
            lease = super().pop(lid)
            self._unfile(lid, lease)
            return lease
        return super().pop(lid, *default)

    def popitem(self):
        lid, lease = super().popitem()
        self._unfile(lid, lease)
        return lid, lease

    def clear(self) -> None:
        super().clear()
        self._rebuild()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._rebuild()

    def setdefault(self, lid: str, default=None):
        if lid not in self:
            self[lid] = default
        return self[lid]


_NO_LEASES: tuple = ()


@dataclass
class ClusterSnapshot:
    """Everything a policy may look at. ``links`` gives the link kind for (host, host) pairs via link_kind()."""

    now: float
    devices: dict[str, DeviceState]
    tenants: dict[str, TenantState]
    leases: dict[str, LeaseState] = field(default_factory=dict)
    intra_host_link: str = "nvlink"
    inter_host_link: str = "nccl"
    epoch: int = 0
    # True when the snapshot's owner calls touch() after every change to a device (the simulator, which keeps one
    # snapshot current in place); policies may then keep indexes over the devices (``device_index``)
    tracked: bool = False
    device_index: Any = field(default=None, init=False, repr=False, compare=False)

    def touch(self, d: DeviceState) -> None:
        """``d``'s fields changed (only meaningful on a tracked snapshot): bring the device index up to date."""
        if self.device_index is not None:
            self.device_index.update(d)

    def __post_init__(self) -> None:
        if not isinstance(self.leases, LeaseTable):
            self.leases = LeaseTable(self.leases)

    def _leases(self) -> LeaseTable:
        leases = self.leases
        if not isinstance(leases, LeaseTable):  # replaced by a plain dict after construction
            leases = self.leases = LeaseTable(leases)
        return leases

    def link_kind(self, a: str, b: str) -> str:
        """Link kind between two devices (same host: intra-host link)."""
        da, db = self.devices[a], self.devices[b]
        return self.intra_host_link if da.host == db.host else self.inter_host_link

    def tenant_devices(self, tenant: str) -> list[DeviceState]:
        """Devices holding an engine of ``tenant``."""
        return [d for d in self.devices.values() if tenant in d.tenants]

    def leases_on(self, device: str) -> Iterable[LeaseState]:
        """Leases hosted by ``device`` (any state), in the order they were added (a view: do not change the
        leases while iterating it)."""
        group = self._leases().by_guest.get(device)
        return group.values() if group else _NO_LEASES

    def leases_from(self, device: str) -> Iterable[LeaseState]:
        """Leases whose home (driving) device is ``device``, in the order they were added (a view)."""
        group = self._leases().by_home.get(device)
        return group.values() if group else _NO_LEASES

    def leases_of(self, tenant: str) -> Iterable[LeaseState]:
        """Leases of ``tenant``, in the order they were added (a view)."""
        group = self._leases().by_tenant.get(tenant)
        return group.values() if group else _NO_LEASES
