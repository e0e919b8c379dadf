"""Leases and weight staging in the GMG (DESIGN §4), each as one atomic commit.

* Staging: the guest reserves memory for a tenant's segment weights (owner ``weights:{tenant}:{segment}``, kind
  ``weights``) and records residency in ``resident:{device}``, in one script.
* Lease commit: a reservation on the guest (owner ``lease:{id}``, kind ``lease``) plus the ``lease:{id}`` hash, the
  ``leases:{guest}`` entry (score = end_ts) and a pin on every staged segment it uses, in one script; refused
  (nothing changed) if the memory does not fit, the id exists, or a segment's weights are not resident.
* Close (revoke, expire, release): frees the reservation, deletes the lease hash and its zset entry and unpins, in
  one script guarded on the lease still being active, so closing twice changes nothing.
* Eviction of staged weights is refused while an active lease pins them. A lease commit may evict cached
  (unpinned) staged weights on the guest in the same script to fit (:meth:`LeaseStore.commit_making_room`).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from shared.gmg.store import Committed, GMGStore, Refused, Reservation, Room

LEASE_STATES = ("active", "revoked", "expired", "released")


@dataclass(frozen=True)
class Lease:
    """A grant to ``tenant`` to run ``segments`` on ``guest`` during [start_ts, end_ts), holding ``nbytes``."""

    lease_id: str
    tenant: str
    guest: str
    segments: tuple[str, ...]
    start_ts: float
    end_ts: float
    nbytes: int
    home: str = ""  # the driver device that sends the activations
    share: float = 1.0  # most of the guest's time the lease may take while the guest's own tenant is busy
    mode: str = "segments"  # segments | sequences (DESIGN §4 second mode; segments == ("*",))
    handback: bool = False  # sequences: prefilled sequences go home (lane hand-off)

    def fields(self, state: str = "active") -> dict[str, str]:
        return {"id": self.lease_id, "tenant": self.tenant, "guest": self.guest, "home": self.home,
                "segments": ",".join(self.segments), "start_ts": f"{self.start_ts:.6f}",
                "end_ts": f"{self.end_ts:.6f}", "nbytes": str(int(self.nbytes)), "share": f"{self.share:.4f}",
                "mode": self.mode, "handback": "1" if self.handback else "0", "state": state,
                "created_ts": f"{time.time():.6f}"}

    @classmethod
    def from_fields(cls, h: dict[str, str]) -> "Lease":
        return cls(h["id"], h["tenant"], h["guest"], tuple(s for s in h.get("segments", "").split(",") if s),
                   float(h["start_ts"]), float(h["end_ts"]), int(h["nbytes"]), h.get("home", ""),
                   float(h.get("share") or 1.0), h.get("mode") or "segments", h.get("handback") == "1")


def lease_owner(lease_id: str) -> str:
    return f"lease:{lease_id}"


def weights_owner(tenant: str, segment: str) -> str:
    return f"weights:{tenant}:{segment}"


class LeaseStore:
    """Lease and staging commits over a :class:`GMGStore` (committers: the scheduler; expiry: the GMG service)."""

    def __init__(self, store: GMGStore) -> None:
        self.store = store
        self.keys = store.keys

    async def commit(self, lease: Lease, *, require_resident: bool = True,
                     stage: dict[str, int] | None = None) -> int | Refused:
        """Commit ``lease`` atomically; returns the epoch or a clean :class:`Refused`. ``stage`` (segment ->
        bytes) stages those of its segments in the same commit (as :meth:`stage` would: refused with
        ``already_resident`` if one of them is resident there already); the others must be resident."""
        res = await self._commit(lease, require_resident, stage, None)
        return res if isinstance(res, Refused) else res.epoch

    async def commit_making_room(self, lease: Lease, recency: Mapping[str, float] | None = None, *,
                                 require_resident: bool = True, stage: dict[str, int] | None = None
                                 ) -> Committed | Refused:
        """:meth:`commit`, evicting on the guest, in the same script, the cached weights it needs the memory of:
        staged weights no active lease pins, least recently leased first by ``recency`` (``"tenant|segment"`` ->
        time; unlisted ones first), never the guest's home tenant's nor the lease's tenant's. Refused with
        nothing evicted when even evicting all of them would not make it fit (:class:`shared.gmg.store.Room`)."""
        return await self._commit(lease, require_resident, stage,
                                  Room(lease.guest, (lease.tenant,), recency or {}))

    async def _commit(self, lease: Lease, require_resident: bool, stage: dict[str, int] | None,
                      room: Room | None) -> Committed | Refused:
        if lease.end_ts <= lease.start_ts or not lease.segments or any("," in s for s in lease.segments):
            return Refused("invalid", lease.guest, "empty window, no segments or a ',' in a segment name")
        k, b = self.keys, self.store.batch()
        stage = stage or {}
        guards = [(k.lease(lease.lease_id), "state", ("",))]
        guards += [(k.resident(lease.guest), f"{lease.tenant}|{s}", ("",)) for s in stage]
        if require_resident:
            guards += [(k.resident(lease.guest), f"{lease.tenant}|{s}", ("*",)) for s in lease.segments
                       if s not in stage]
        items = [Reservation(lease.guest, weights_owner(lease.tenant, s), "weights", lease.tenant, n)
                 for s, n in stage.items()]
        if stage:
            b.hset(k.resident(lease.guest), {f"{lease.tenant}|{s}": n for s, n in stage.items()})
        b.hset(k.lease(lease.lease_id), lease.fields())
        b.add("zadd", k.leases(lease.guest), f"{lease.end_ts:.6f}", lease.lease_id)
        for s in lease.segments:
            b.add("hincrby", k.pins(lease.guest), f"{lease.tenant}|{s}", 1)
        items.append(Reservation(lease.guest, lease_owner(lease.lease_id), "lease", lease.tenant, lease.nbytes))
        res = await self.store.commit_making_room("lease_commit", items, [room] if room else [], guards=guards,
                                                  batch=b)
        if isinstance(res, Refused) and res.reason == "conflict":
            if res.device == "state":
                return Refused("lease_exists", lease.guest, lease.lease_id)
            staged_field = res.device.split("|", 1)[-1] in stage
            return Refused("already_resident" if staged_field else "not_resident", lease.guest, res.device)
        return res

    async def close(self, lease_id: str, state: str = "revoked", reason: str = "") -> Lease | None:
        """End an active lease (revoke/expire/release); ``None`` if it was not active (closing is idempotent)."""
        if state not in LEASE_STATES[1:]:
            raise ValueError(f"close state must be one of {LEASE_STATES[1:]}, got {state!r}")
        k = self.keys
        raw = await self.store.redis.hgetall(k.lease(lease_id))
        h = {_s(a): _s(v) for a, v in raw.items()}
        if h.get("state") != "active":
            return None
        lease = Lease.from_fields(h)
        b = self.store.batch()
        b.add("del", k.lease(lease_id))
        b.add("zrem", k.leases(lease.guest), lease_id)
        for s in lease.segments:
            b.add("hincrby", k.pins(lease.guest), f"{lease.tenant}|{s}", -1)
        res = await self.store.release_many(f"lease_{state}", [(lease.guest, lease_owner(lease_id))],
                                            guards=[(k.lease(lease_id), "state", ("active",))], batch=b)
        return None if isinstance(res, Refused) else lease

    async def expire(self, now: float) -> list[str]:
        """Close every active lease whose window ended by ``now``; returns their ids."""
        ids = sorted(_s(x) for x in await self.store.redis.smembers(self.keys.devices))
        pipe = self.store.redis.pipeline(transaction=False)
        for d in ids:
            pipe.zrangebyscore(self.keys.leases(d), "-inf", now)
        out = []
        for ended in await pipe.execute():
            for lid in ended:
                if await self.close(_s(lid), "expired", "window_ended") is not None:
                    out.append(_s(lid))
        return out

    async def active(self, device: str) -> list[Lease]:
        """Active leases on a guest device, by end time."""
        ids = [_s(x) for x in await self.store.redis.zrange(self.keys.leases(device), 0, -1)]
        pipe = self.store.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(self.keys.lease(i))
        rows = await pipe.execute()
        return [Lease.from_fields({_s(a): _s(v) for a, v in r.items()}) for r in rows if r]

    # ------------------------------------------------------------ staging
    async def resident(self, device: str, tenant: str, segments) -> set[str]:
        """Which of ``tenant``'s ``segments`` are resident on ``device`` now (staged or home)."""
        segs = list(segments)
        vals = await self.store.redis.hmget(self.keys.resident(device), [f"{tenant}|{s}" for s in segs])
        return {s for s, v in zip(segs, vals) if v is not None}

    async def unpinned(self, device: str, exclude: tuple[str, ...] = ()) -> list[tuple[str, str, int]]:
        """(tenant, segment, bytes) of the weights resident on ``device`` that no active lease pins, leaving out
        the tenants in ``exclude`` (pass the device's home tenant: home weights are never evicted)."""
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.resident(device))
        pipe.hgetall(self.keys.pins(device))
        res, pins = await pipe.execute()
        return unpinned_entries(res, pins, exclude)

    async def stage(self, device: str, tenant: str, segments: dict[str, int]) -> int | Refused:
        """Reserve memory for ``segments`` (name -> bytes) of ``tenant`` on ``device`` and mark them resident;
        refused when one is resident there already (staged before, or the device is the tenant's home)."""
        b = self.store.batch().hset(self.keys.resident(device), {f"{tenant}|{s}": n for s, n in segments.items()})
        items = [Reservation(device, weights_owner(tenant, s), "weights", tenant, n) for s, n in segments.items()]
        guards = [(self.keys.resident(device), f"{tenant}|{s}", ("",)) for s in segments]
        res = await self.store.commit("stage_weights", items, guards=guards, batch=b)
        if isinstance(res, Refused) and res.reason == "conflict":
            return Refused("already_resident", device, res.device)
        return res

    async def evict(self, device: str, tenant: str, segments: list[str]) -> int | Refused:
        """Free staged ``segments``; returns the bytes freed. Refused (nothing freed) while an active lease pins any
        of them, or when one is not staged there (home weights are never evicted)."""
        k, b = self.keys, self.store.batch()
        fields = [f"{tenant}|{s}" for s in segments]
        b.add("hdel", k.resident(device), *fields)
        b.add("hdel", k.pins(device), *fields)
        guards = [(k.reservations(device), weights_owner(tenant, s), ("*",)) for s in segments]
        guards += [(k.pins(device), f, ("", "0")) for f in fields]
        res = await self.store.release_many("evict_weights", [(device, weights_owner(tenant, s)) for s in segments],
                                            guards=guards, batch=b)
        if isinstance(res, Refused):
            return Refused("not_staged" if res.detail.startswith("weights:") else "pinned", device, res.detail)
        return res[0]


def unpinned_entries(resident: dict, pins: dict, exclude=()) -> list[tuple[str, str, int]]:
    """(tenant, segment, bytes) of a device's ``resident`` hash entries whose ``pins`` count is 0, tenants in
    ``exclude`` left out (raw HGETALL replies, bytes or str)."""
    pinned = {_s(f): int(_s(v) or 0) for f, v in pins.items()}
    out = []
    for f, n in resident.items():
        field = _s(f)
        tenant, _, seg = field.partition("|")
        if tenant in exclude or pinned.get(field, 0) > 0:
            continue
        out.append((tenant, seg, int(float(_s(n) or 0))))
    return out


async def expire_leases(store: GMGStore, now: float) -> list[str]:
    """Close leases whose window ended (the GMG service's sweep)."""
    return await LeaseStore(store).expire(now)


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
