"""Decisions of the GMG's start-up reconciliation and of stream expiry, as plain functions (no Redis here).

At every start the GMG service compares what Redis holds under the prefix with the configured cluster and tenants
(:class:`Desired`) and removes what no longer belongs to them: devices and their per-device keys, tenants and
their graphs, residency, reservations, leases, pins, and the per-tenant / per-device keys other services derive
from the config. Where removal could lose work — a worker that serves the old config is still running — the plan
carries a *conflict* instead, and the GMG refuses to start (after waiting for such workers to go away).
The I/O side is :mod:`services.gmg.housekeeping`; what is kept and what is dropped: docs/reliability.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from shared.config import ClusterConfig, TenantsConfig, env_number
from shared.gmg.keys import GMGKeys
from shared.gmg.store import model_id, segment_bytes
from shared.messages import sim_reply_stream, tokens_stream, worker_stream
from shared.requests_state import TERMINAL_STATES

# GMG key kinds that belong to one device (``{gmg}:<kind>:<device>``)
DEVICE_KINDS = ("device", "reservations", "resident", "pins", "leases", "exec", "reqs", "finished", "busy")
WHOLE_MODEL = "*"  # the segment name of a whole staged model (sequence leases)


@dataclass(frozen=True)
class ReconcileOptions:
    """Settings of reconciliation and stream expiry (from the environment, built once in ``__main__``)."""

    wait_s: float = 10.0  # how long to wait for a running worker of the old config to stop before refusing
    stream_expiry_s: float = 300.0  # streams of dead gateways / removed devices / idle what-if clients

    @classmethod
    def from_env(cls, env=None) -> "ReconcileOptions":
        return cls(wait_s=env_number("SLICESCHED_RECONCILE_WAIT_S", 10.0, minimum=0, env=env),
                   stream_expiry_s=env_number("SLICESCHED_STREAM_EXPIRY_S", 300.0, above=0, env=env))

    @property
    def expiry_check_s(self) -> float:
        """How often streams are checked for expiry."""
        return min(30.0, max(0.5, self.stream_expiry_s / 2))


class ReconcileRefused(Exception):
    """The GMG will not remove state that running workers of an older config still use."""

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


@dataclass(frozen=True)
class Desired:
    """What the config says should exist."""

    devices: frozenset[str]
    homes: dict[str, tuple[str, ...]]  # tenant -> home devices
    home_of: dict[str, str]  # device -> its home tenant (devices home to no tenant are absent)
    segments: dict[str, dict[str, int]]  # tenant -> segment -> weight bytes
    model_ids: dict[str, str]
    weight_bytes: dict[str, int] = field(default_factory=dict)  # tenant -> the model's weight bytes
    cluster_source: str = "cluster config"
    tenants_source: str = "tenants config"

    @classmethod
    def from_config(cls, cluster: ClusterConfig, tenants: TenantsConfig) -> "Desired":
        return cls(devices=frozenset(d.id for d in cluster.devices),
                   homes={t.name: tuple(t.home_devices) for t in tenants.tenants},
                   home_of=tenants.home_of(),
                   segments={t.name: _segments(t.model.config) for t in tenants.tenants},
                   model_ids={t.name: model_id(t.model) for t in tenants.tenants},
                   weight_bytes={t.name: t.model.config.weight_bytes() for t in tenants.tenants},
                   cluster_source=cluster.source, tenants_source=tenants.source)


@functools.lru_cache(maxsize=64)
def _segments(cfg) -> dict[str, int]:
    return segment_bytes(cfg)


@dataclass
class StoredState:
    """What Redis holds (every value decoded to str)."""

    gmg_keys: list[str] = field(default_factory=list)  # every ``{gmg}`` key under the prefix
    devices: set[str] = field(default_factory=set)  # members of ``{gmg}:devices``
    tenants: set[str] = field(default_factory=set)  # members of ``{gmg}:tenants``
    tenant_rows: dict[str, dict[str, str]] = field(default_factory=dict)
    reservations: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> owner -> kind|tenant|bytes|ts
    resident: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> "tenant|segment" -> bytes
    pins: dict[str, dict[str, str]] = field(default_factory=dict)
    lease_index: dict[str, list[str]] = field(default_factory=dict)  # device -> lease ids in its zset
    leases: dict[str, dict[str, str]] = field(default_factory=dict)  # lease id -> lease hash
    running: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> request id -> tenant|running|ts
    finished: dict[str, list[str]] = field(default_factory=dict)  # device -> "request|tenant|outcome"
    journeys: dict[str, str] = field(default_factory=dict)  # request id -> state ('' = no journey hash)
    workers: dict[str, dict[str, str]] = field(default_factory=dict)  # device -> live worker's health key
    tenant_stats: list[str] = field(default_factory=list)  # tenants with a sched:tenant:{t} hash
    forecasts: list[str] = field(default_factory=list)  # devices with a sim:forecast:{d} hash
    rates_fields: list[str] = field(default_factory=list)  # fields of sim:rates
    corrections_fields: list[str] = field(default_factory=list)  # fields of sim:corrections


@dataclass
class ReconcilePlan:
    """What to remove, and the conflicts that forbid removing it."""

    removed_devices: list[str] = field(default_factory=list)
    removed_tenants: list[str] = field(default_factory=list)
    changed_models: list[str] = field(default_factory=list)
    close_leases: list[tuple[str, str]] = field(default_factory=list)  # (lease id, why): guest stays configured
    release: list[tuple[str, str, str]] = field(default_factory=list)  # (device, owner, why)
    delete: list[str] = field(default_factory=list)  # GMG keys
    srem: dict[str, list[str]] = field(default_factory=dict)  # GMG set -> members
    hdel: dict[str, list[str]] = field(default_factory=dict)  # GMG hash -> fields
    zrem: dict[str, list[str]] = field(default_factory=dict)  # GMG sorted set -> members
    tenant_stats: list[str] = field(default_factory=list)  # sched:tenant:{t} to delete
    forecasts: list[str] = field(default_factory=list)  # sim:forecast:{d} to delete
    rates_fields: list[str] = field(default_factory=list)  # sim:rates fields to delete
    corrections_fields: list[str] = field(default_factory=list)  # sim:corrections fields to delete
    conflicts: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.close_leases or self.release or self.delete or self.srem or self.hdel or self.zrem
                    or self.tenant_stats or self.forecasts or self.rates_fields or self.corrections_fields)

    def summary(self) -> dict:
        """Counts and names for the ``gmg_reconciled`` log line."""
        return {"removed_devices": ",".join(self.removed_devices), "removed_tenants": ",".join(self.removed_tenants),
                "changed_models": ",".join(self.changed_models), "leases_closed": len(self.close_leases),
                "reservations_released": len(self.release), "keys_deleted": len(self.delete),
                "fields_deleted": sum(len(v) for v in self.hdel.values()) + len(self.rates_fields)
                + len(self.corrections_fields), "stats_deleted": len(self.tenant_stats) + len(self.forecasts)}


def _add(d: dict[str, list[str]], key: str, member: str) -> None:
    d.setdefault(key, []).append(member)


def plan_reconcile(state: StoredState, want: Desired, keys: GMGKeys) -> ReconcilePlan:
    """Everything in ``state`` that ``want`` no longer describes, and the conflicts (running old-config workers)."""
    plan = ReconcilePlan()
    by_device: dict[str, list[str]] = {}
    stored_tenants = set(state.tenants)
    for k in state.gmg_keys:
        kind, ident = keys.parse(k)
        if kind in DEVICE_KINDS:
            by_device.setdefault(ident, []).append(k)
        elif kind in ("tenant", "model"):
            stored_tenants.add(ident)
    stored_devices = set(state.devices) | set(by_device)
    plan.removed_devices = sorted(stored_devices - want.devices)
    plan.removed_tenants = sorted(stored_tenants - set(want.homes))
    plan.changed_models = sorted(t for t in want.homes if t in state.tenant_rows
                                 and _model_changed(state.tenant_rows[t], want, t))
    changed = set(plan.changed_models)
    _conflicts(plan, state, want)

    for d in plan.removed_devices:
        plan.delete += sorted(by_device.get(d, []))
        if d in state.devices:
            _add(plan.srem, keys.devices, d)
    for t in plan.removed_tenants:
        plan.delete += [keys.tenant(t), keys.model_graph(t)]
        if t in state.tenants:
            _add(plan.srem, keys.tenants, t)

    kept_leases = _leases(plan, state, want, keys, changed)
    for d in sorted(stored_devices & want.devices):
        _device(plan, state, want, keys, d, changed, kept_leases)

    plan.tenant_stats = sorted(t for t in state.tenant_stats if t not in want.homes)
    plan.forecasts = sorted(d for d in state.forecasts if d not in want.devices)
    plan.rates_fields = sorted(f for f in state.rates_fields
                               if f not in ("ts", "window_s") and f.split(":", 1)[0] not in want.homes)
    plan.corrections_fields = sorted(f for f in state.corrections_fields if f.split("/", 1)[0] not in want.devices)
    return plan


def _model_changed(row: dict[str, str], want: Desired, tenant: str) -> bool:
    if row.get("model_id"):
        return row["model_id"] != want.model_ids[tenant]
    # written before model ids existed: compare the weight bytes
    return str(row.get("weight_bytes", "")) != str(want.weight_bytes.get(tenant, ""))


def _conflicts(plan: ReconcilePlan, state: StoredState, want: Desired) -> None:
    for d, hk in sorted(state.workers.items()):
        pid = hk.get("pid", "?")
        if d not in want.devices:
            plan.conflicts.append(
                f"device {d!r} is not in {want.cluster_source} but its worker (pid {pid}) is still running: "
                f"removing the device would lose the requests it runs; stop that worker first")
            continue
        serves, home = hk.get("tenant", ""), want.home_of.get(d, "")
        if serves and serves != home:
            plan.conflicts.append(
                f"device {d!r} runs a worker (pid {pid}) serving tenant {serves!r}, but {want.tenants_source} "
                f"makes it home to {home or 'no tenant'!r}: removing that tenant's state would lose the requests "
                f"it runs; stop that worker first")


def _segments_ok(tenant: str, segments: list[str], want: Desired) -> bool:
    return bool(segments) and all(s == WHOLE_MODEL or s in want.segments[tenant] for s in segments)


def _leases(plan: ReconcilePlan, state: StoredState, want: Desired, keys: GMGKeys, changed: set[str]) -> set[str]:
    """Decide every lease hash; returns the ids kept."""
    indexed = {lid: d for d, ids in state.lease_index.items() for lid in ids}
    kept = set()
    for lid, h in sorted(state.leases.items()):
        t, guest, home = h.get("tenant", ""), h.get("guest", ""), h.get("home", "")
        why = ""
        if t not in want.homes:
            why = "tenant removed"
        elif guest not in want.devices or (home and home not in want.devices):
            why = "device removed"
        elif guest in want.homes[t]:
            why = "guest is now the tenant's home"
        elif t in changed:
            why = "model changed"
        elif not _segments_ok(t, [s for s in h.get("segments", "").split(",") if s], want):
            why = "segments not in the model"
        elif lid not in indexed:
            why = "not indexed on its guest"
        if not why:
            kept.add(lid)
        elif guest in want.devices and lid in indexed and h.get("state") == "active":
            plan.close_leases.append((lid, why))
        else:
            plan.delete.append(keys.lease(lid))
    for d, ids in sorted(state.lease_index.items()):
        if d in want.devices:
            for lid in ids:
                if lid not in state.leases:
                    _add(plan.zrem, keys.leases(d), lid)
    return kept


def _device(plan: ReconcilePlan, state: StoredState, want: Desired, keys: GMGKeys, d: str, changed: set[str],
            kept_leases: set[str]) -> None:
    """Reservations, residency, pins and execution records of a device that stays."""
    closing = {lid for lid, _ in plan.close_leases}
    kept_staged: set[str] = set()
    for owner, v in sorted(state.reservations.get(d, {}).items()):
        parts = v.split("|")
        tenant = parts[1] if len(parts) > 1 else ""
        why = _reservation_why(owner, tenant, parts, d, want, changed, kept_leases, closing, state)
        if why is None:
            if owner.startswith("weights:") and not owner.endswith(":home"):
                kept_staged.add(owner)
            continue
        if why:
            plan.release.append((d, owner, why))
    dropped_fields = set()
    for f in sorted(state.resident.get(d, {})):
        tenant, _, seg = f.partition("|")
        ok = tenant in want.homes and (seg == WHOLE_MODEL or seg in want.segments[tenant]) and (
            d in want.homes[tenant] or (tenant not in changed and f"weights:{tenant}:{seg}" in kept_staged))
        if not ok:
            _add(plan.hdel, keys.resident(d), f)
            dropped_fields.add(f)
    for f in sorted(state.pins.get(d, {})):
        if f in dropped_fields or f.partition("|")[0] not in want.homes:
            _add(plan.hdel, keys.pins(d), f)
    for rid, v in sorted(state.running.get(d, {}).items()):
        if v.split("|")[0] not in want.homes or _ended(state, rid):
            _add(plan.hdel, keys.requests(d), rid)
    for m in state.finished.get(d, []):
        parts = m.split("|")
        if len(parts) >= 2 and parts[1] not in want.homes:
            _add(plan.zrem, keys.finished(d), m)


def _reservation_why(owner: str, tenant: str, parts: list[str], d: str, want: Desired, changed: set[str],
                     kept_leases: set[str], closing: set[str], state: StoredState) -> str | None:
    """Why a reservation goes (``None``: it stays; ``''``: a lease close releases it)."""
    if tenant and tenant not in want.homes:
        return "tenant removed"
    if owner.startswith("weights:"):
        seg = owner.rsplit(":", 1)[-1]
        if seg == "home":
            return None if d in want.homes.get(tenant, ()) else "not the tenant's home"
        if d in want.homes.get(tenant, ()):
            return "the tenant's home holds these weights"
        if tenant in changed:
            return "model changed"
        if seg != WHOLE_MODEL and (seg not in want.segments.get(tenant, {})
                                   or str(want.segments[tenant][seg]) != (parts[2] if len(parts) > 2 else "")):
            return "segment not in the model"
        return None
    if owner.startswith("lease:"):
        lid = owner[len("lease:"):]
        if lid in closing:
            return ""
        return None if lid in kept_leases else "no such lease"
    if owner.startswith("kv:"):
        return "request ended" if _ended(state, owner[len("kv:"):]) else None
    return None


def _ended(state: StoredState, request_id: str) -> bool:
    st = state.journeys.get(request_id)
    return st is not None and (st == "" or st in TERMINAL_STATES)


# ---------------------------------------------------------------- stream expiry
@dataclass(frozen=True)
class StreamInfo:
    """A stream under the prefix: ``kind`` tokens | worker | reply, ``owner`` the gateway / device / client id,
    ``last_ts`` the time of its newest entry (0 when it never had one)."""

    key: str
    kind: str
    owner: str
    last_ts: float


def classify_stream(key: str, prefix: str) -> tuple[str, str]:
    """(kind, owner) of a stream that may expire; ("", "") for the mesh's own streams (requests, events, ...)."""
    for kind, head in (("tokens", tokens_stream(prefix, "")), ("worker", worker_stream(prefix, "")),
                       ("reply", sim_reply_stream(prefix, ""))):
        if key.startswith(head) and len(key) > len(head):
            return kind, key[len(head):]
    return "", ""


def expired_streams(streams: list[StreamInfo], *, live_gateways: set[str], live_workers: set[str],
                    devices: frozenset[str] | set[str], now: float, expiry_s: float) -> list[str]:
    """Streams to delete: a gateway's tokens stream once the gateway's health key is gone; a worker stream of a
    device no longer configured once no worker reports for it; a what-if reply stream; each only when nothing was
    added to it for ``expiry_s``."""
    out = []
    for s in streams:
        if now - s.last_ts < expiry_s:
            continue
        if s.kind == "tokens" and s.owner not in live_gateways:
            out.append(s.key)
        elif s.kind == "worker" and s.owner not in devices and s.owner not in live_workers:
            out.append(s.key)
        elif s.kind == "reply":
            out.append(s.key)
    return out

