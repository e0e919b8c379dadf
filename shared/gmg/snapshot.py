"""The GMG as pure data: a typed, read-only view over a copy of the GMG keys (a *mirror*, see
:mod:`shared.gmg.mutations`). Built by :class:`shared.gmg.follower.GMGFollower`; no Redis here."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from shared.gmg.keys import GMGKeys
from shared.gmg.lease_store import Lease
from shared.gmg.store import Reservation


def _i(v: Any) -> int:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return 0


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class DeviceRecord:
    """One device as the GMG stores it: static profile, memory accounting and the newest heartbeat."""

    id: str
    kind: str
    backend: str
    host: str
    capacity: int
    limit: int  # capacity - headroom: reservations never exceed it
    reserved: int
    used: int  # measured by the worker
    state: str  # ready | starting | draining | down
    home_tenant: str
    heartbeat_ts: float = 0.0
    worker_id: str = ""
    kv_used: int = 0
    kv_total: int = 0
    running: int = 0
    queued: int = 0
    busy_ratio: float = 0.0

    @property
    def headroom(self) -> int:
        return self.capacity - self.limit

    @property
    def free(self) -> int:
        """Bytes that can still be reserved."""
        return self.limit - self.reserved

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "DeviceRecord":
        return cls(id=h.get("id", ""), kind=h.get("kind", ""), backend=h.get("backend", ""), host=h.get("host", ""),
                   capacity=_i(h.get("capacity")), limit=_i(h.get("limit")), reserved=_i(h.get("reserved")),
                   used=_i(h.get("used")), state=h.get("state", "down"), home_tenant=h.get("home_tenant", ""),
                   heartbeat_ts=_f(h.get("heartbeat_ts")), worker_id=h.get("worker_id", ""),
                   kv_used=_i(h.get("kv_used")), kv_total=_i(h.get("kv_total")), running=_i(h.get("running")),
                   queued=_i(h.get("queued")), busy_ratio=_f(h.get("busy_ratio")))


@dataclass(frozen=True)
class TenantRecord:
    """One tenant as the GMG stores it (policies see :class:`shared.policies.snapshot.TenantState`)."""

    name: str
    model: str
    sla_ttft_ms: float
    sla_tpot_ms: float
    home_devices: tuple[str, ...]
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> "TenantRecord":
        return cls(name=h.get("name", ""), model=h.get("model", ""), sla_ttft_ms=_f(h.get("sla_ttft_ms")),
                   sla_tpot_ms=_f(h.get("sla_tpot_ms")),
                   home_devices=tuple(x for x in h.get("home_devices", "").split(",") if x),
                   weight_bytes=_i(h.get("weight_bytes")), kv_bytes_per_token=_i(h.get("kv_bytes_per_token")))


@dataclass(frozen=True)
class RunningRequest:
    request_id: str
    tenant: str
    state: str
    started_ts: float


@dataclass(frozen=True)
class GMGSnapshot:
    """The whole GMG at one epoch."""

    epoch: int
    devices: dict[str, DeviceRecord]
    tenants: dict[str, TenantRecord]
    reservations: dict[str, dict[str, Reservation]]  # device -> owner -> reservation (weights, KV, leases, ...)
    resident: dict[str, dict[tuple[str, str], int]]  # device -> (tenant, segment) -> bytes
    pins: dict[str, dict[tuple[str, str], int]]  # device -> (tenant, segment) -> active leases using it
    leases: dict[str, Lease]  # active leases by id
    exec_state: dict[str, dict[str, str]]  # device -> execution-state hash
    requests: dict[str, dict[str, RunningRequest]]  # device -> request_id -> running request
    busy: dict[str, list[tuple[float, float]]]  # device -> recent busy intervals, by end
    graph_blobs: dict[str, bytes] = field(default_factory=dict, compare=False)  # tenant -> msgpack ModelGraph

    @classmethod
    def from_mirror(cls, keys: GMGKeys, mirror: dict[str, Any], epoch: int, *, cache: dict | None = None,
                    dirty: set[str] | None = None) -> "GMGSnapshot":
        """Build the typed view of a mirror (key -> hash dict / set / zset dict / bytes).

        With ``cache`` (key -> parsed value, kept by the caller between calls) and ``dirty`` (keys changed since
        the previous call), only changed keys are parsed again; ``dirty=None`` parses everything.
        """
        cache = {} if cache is None else cache
        if dirty is None:
            cache.clear()
        else:
            for k in dirty:
                cache.pop(k, None)
        devs, tens, res, resident, pins, leases, ex, reqs, busy, graphs = ({} for _ in range(10))
        out = {"device": devs, "tenant": tens, "reservations": res, "resident": resident, "pins": pins,
               "lease": leases, "exec": ex, "reqs": reqs, "busy": busy, "model": graphs}
        for key, v in mirror.items():
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = _parse(keys, key, v)
            kind, ident, parsed = hit
            if parsed is not None and kind in out:
                out[kind][ident] = parsed
        if len(cache) > len(mirror):
            for k in [k for k in cache if k not in mirror]:
                del cache[k]
        return cls(epoch, devs, tens, res, resident, pins, leases, ex, reqs, busy, graphs)

    # ------------------------------------------------------------ queries
    def kv_location(self, request_id: str) -> list[tuple[str, int]]:
        """Where a request's KV lives: (device, bytes) per device holding a ``kv:{request_id}`` reservation."""
        owner = f"kv:{request_id}"
        return [(d, r[owner].nbytes) for d, r in self.reservations.items() if owner in r]

    def holders(self, tenant: str, segment: str) -> list[str]:
        """Devices that hold ``tenant``'s weights of ``segment``."""
        return sorted(d for d, r in self.resident.items() if (tenant, segment) in r)

    def reserved_by_kind(self, device: str) -> dict[str, int]:
        """Reserved bytes on ``device`` per reservation kind (weights, kv, lease, activation, staging)."""
        out: dict[str, int] = {}
        for r in self.reservations.get(device, {}).values():
            out[r.kind] = out.get(r.kind, 0) + r.nbytes
        return out

    def leases_on(self, device: str) -> list[Lease]:
        return sorted((x for x in self.leases.values() if x.guest == device), key=lambda x: x.end_ts)

    @cached_property
    def graphs(self) -> dict[str, Any]:
        """Each tenant's :class:`~shared.model.graph.ModelGraph` (decoded on first use)."""
        from shared.model.graph import ModelGraph

        return {t: ModelGraph.from_dict(msgspec.msgpack.decode(b)) for t, b in self.graph_blobs.items()}


def _parse(keys: GMGKeys, key: str, v: Any) -> tuple[str, str, Any]:
    """(kind, id, typed value) of one mirrored key; value None for keys the snapshot does not expose."""
    kind, ident = keys.parse(key)
    if kind == "device":
        return kind, ident, DeviceRecord.from_hash(v)
    if kind == "tenant":
        return kind, ident, TenantRecord.from_hash(v)
    if kind == "reservations":
        return kind, ident, {o: _reservation(ident, o, x) for o, x in v.items()}
    if kind in ("resident", "pins"):
        return kind, ident, {tuple(f.split("|", 1)): _i(x) for f, x in v.items()}
    if kind == "lease":
        return kind, ident, Lease.from_fields(v) if v.get("state") == "active" else None
    if kind == "exec":
        return kind, ident, dict(v)
    if kind == "reqs":
        return kind, ident, {r: _running(r, x) for r, x in v.items()}
    if kind == "busy":
        return kind, ident, sorted((_f(m.split(":")[0]), _f(m.split(":")[1])) for m in v)
    if kind == "model":
        return kind, ident, v
    return kind, ident, None


def _reservation(device: str, owner: str, v: str) -> Reservation:
    kind, tenant, nbytes, _ts = v.split("|")
    return Reservation(device, owner, kind, tenant, int(nbytes))


def _running(rid: str, v: str) -> RunningRequest:
    tenant, state, ts = v.split("|")
    return RunningRequest(rid, tenant, state, _f(ts))
