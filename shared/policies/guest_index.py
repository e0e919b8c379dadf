"""Indexes over a tracked snapshot's devices, so that a decision does not scan the whole cluster.

Guest candidates for a lease (:class:`GuestIndex`); the least-loaded device of a tenant's container
(:class:`LoadIndex`, what :func:`shared.policies.base.least_loaded` finds by scanning).


``slice`` ranks guest candidates by ``(idle, -staged, same host, load, -free memory, id)`` and asks the what-if
about the first few (``max_candidates``). ``staged`` (the tenant's weights already on the guest) and ``same host``
depend on the tenant and home asking; the rest of the key does not. So a :class:`GuestIndex` keeps every device
filed under its *base key* ``(idle, load, -free memory, id)`` in one sorted list, updated when the snapshot's owner
reports a device changed (:meth:`ClusterSnapshot.touch`), plus which devices hold which tenant's staged weights.
The ranking is then: the devices on the home's host and those with the tenant's weights staged (few), and the
first ``k`` others in base-key order — among devices with the same ``staged`` and ``same host`` terms (both 0 and
1) the full key orders exactly as the base key, so no device further down can make the first ``k``. The result
is the same list, in the same order, as sorting every device by the full key.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Callable, Iterable

from shared.policies.snapshot import DeviceState

STAGED_SEGMENTS = ("*", "mlp[0]")  # the resident entries the ranking's "staged" term looks at


def base_key(g: DeviceState) -> tuple:
    """``(idle, load, -free memory, id)``: the part of the ranking that does not depend on who asks."""
    out = g.queued + g.running  # g.outstanding, g.free_bytes spelled out (this runs on every device change)
    return (0 if not (g.busy or out) else 1, out + g.queued_prefill_tokens / 2048,
            -(g.capacity_bytes - g.headroom_bytes - g.used_bytes + g.evictable_bytes), g.id)


def full_key(g: DeviceState, tenant: str | None, host: str) -> tuple:
    """The ranking key of ``g`` as a guest for ``tenant`` at home on ``host`` (smaller is better)."""
    staged = ((tenant, "*") in g.resident) + ((tenant, "mlp[0]") in g.resident)
    return (0 if not (g.busy or g.outstanding) else 1, -staged, 0 if g.host == host else 1,
            g.outstanding + g.queued_prefill_tokens / 2048, -(g.free_bytes + g.evictable_bytes), g.id)


def rank_all(devices: Iterable[DeviceState], tenant: str | None, host: str, k: int,
             eligible: Callable[[DeviceState], bool]) -> list[DeviceState]:
    """The first ``k`` eligible devices by :func:`full_key`, by scanning them all."""
    scored = [(full_key(g, tenant, host), g) for g in devices if eligible(g)]
    scored.sort(key=lambda x: x[0])
    return [g for _, g in scored[:k]]


class GuestIndex:
    """Devices of one snapshot in base-key order, kept current by :meth:`update` (see the module docstring)."""

    def __init__(self, devices: dict[str, DeviceState]) -> None:
        self.devices = devices
        self._key: dict[str, tuple] = {}
        self._order: list[tuple] = []
        self._resident: dict[str, tuple[object, frozenset]] = {}  # device -> (resident dict, its staged keys)
        self._staged: dict[tuple[str, str], set[str]] = {}  # (tenant, segment) -> devices holding it
        self._by_host: dict[str, list[DeviceState]] = {}
        for g in devices.values():
            self._by_host.setdefault(g.host, []).append(g)
            key = self._key[g.id] = base_key(g)
            self._order.append(key)
            self._file_resident(g)
        self._order.sort()

    def _file_resident(self, g: DeviceState) -> None:
        old = self._resident.get(g.id)
        if old is not None and old[0] is g.resident:
            return
        keys = frozenset(k for k in g.resident if k[1] in STAGED_SEGMENTS)
        if old is not None:
            for k in old[1] - keys:
                self._staged[k].discard(g.id)
        for k in keys - (old[1] if old is not None else frozenset()):
            self._staged.setdefault(k, set()).add(g.id)
        self._resident[g.id] = (g.resident, keys)

    def update(self, g: DeviceState) -> None:
        """``g``'s state changed: file it under its new key."""
        key = base_key(g)
        old = self._key[g.id]
        if key != old:
            order = self._order
            del order[bisect_left(order, old)]
            insort(order, key)
            self._key[g.id] = key
        self._file_resident(g)

    def rank(self, tenant: str | None, host: str, k: int, eligible: Callable[[DeviceState], bool]) -> list[DeviceState]:
        """Same as :func:`rank_all` over every device of the snapshot."""
        devices = self.devices
        special: dict[str, DeviceState] = {g.id: g for g in self._by_host.get(host, ())}
        for seg in STAGED_SEGMENTS:
            for did in self._staged.get((tenant, seg), ()):  # type: ignore[arg-type]
                special[did] = devices[did]
        picked = [g for g in special.values() if eligible(g)]
        n = 0
        if k > 0:
            for key in self._order:
                did = key[-1]
                if did in special:
                    continue
                g = devices[did]
                if eligible(g):
                    picked.append(g)
                    n += 1
                    if n >= k:
                        break
        scored = [(full_key(g, tenant, host), g) for g in picked]
        scored.sort(key=lambda x: x[0])
        return [g for _, g in scored[:k]]


class LoadIndex:
    """Each container's devices in :func:`~shared.policies.base.least_loaded` order: ``(queued + running, queued
    prompt tokens, position in the container)``; the first one not at the queue cap and not draining is what the
    scan returns (it keeps the first of equal keys, so position breaks ties the same way)."""

    def __init__(self, devices: dict[str, DeviceState], containers: dict[str, list[str]]) -> None:
        self.devices = devices
        self.containers = dict(containers)  # the same list objects: least_loaded() checks identity
        self._sizes = {t: len(ds) for t, ds in containers.items()}
        self._order: dict[str, list[tuple]] = {}
        self._key: dict[tuple[str, int], tuple] = {}
        self._where: dict[str, list[tuple[str, int]]] = {}
        for t, ds in self.containers.items():
            keys = []
            for pos, did in enumerate(ds):
                g = devices[did]
                key = self._key[(t, pos)] = (g.queued + g.running, g.queued_prefill_tokens, pos, did)
                keys.append(key)
                self._where.setdefault(did, []).append((t, pos))
            keys.sort()
            self._order[t] = keys

    def update(self, g: DeviceState) -> None:
        for t, pos in self._where.get(g.id, ()):
            key = (g.queued + g.running, g.queued_prefill_tokens, pos, g.id)
            old = self._key[(t, pos)]
            if key != old:
                order = self._order[t]
                del order[bisect_left(order, old)]
                insort(order, key)
                self._key[(t, pos)] = key

    def least_loaded(self, tenant: str, devs: list[str], cap: int) -> tuple[bool, str | None]:
        """(known, device): ``known`` is False when ``devs`` is not the container this index was built for."""
        if self.containers.get(tenant) is not devs or self._sizes[tenant] != len(devs):
            return False, None
        devices = self.devices
        for key in self._order[tenant]:
            g = devices[key[3]]
            if g.queued >= cap or g.draining:
                continue
            return True, key[3]
        return True, None


class Indexes:
    """What ``slice`` keeps on a tracked snapshot (``ClusterSnapshot.device_index``). A device change only marks
    the device (the simulator reports one per event); each index refiles the devices marked since it was last
    asked, just before it answers, so that many changes of one device between two questions cost one refiling."""

    def __init__(self, devices: dict[str, DeviceState], containers: dict[str, list[str]]) -> None:
        self.devices = devices
        self._guests = GuestIndex(devices)
        self._load = LoadIndex(devices, containers)
        self._dirty_guests: set[str] = set()
        self._dirty_load: set[str] = set()

    def update(self, g: DeviceState) -> None:
        self._dirty_guests.add(g.id)
        self._dirty_load.add(g.id)

    @property
    def guests(self) -> GuestIndex:
        if self._dirty_guests:
            for did in self._dirty_guests:
                self._guests.update(self.devices[did])
            self._dirty_guests.clear()
        return self._guests

    @property
    def load(self) -> LoadIndex:
        if self._dirty_load:
            for did in self._dirty_load:
                self._load.update(self.devices[did])
            self._dirty_load.clear()
        return self._load
