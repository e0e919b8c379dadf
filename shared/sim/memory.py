"""Memory of one simulated device over time: reservations by kind, a timeline, an LRU cache of staged weights."""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("weights", "kv", "staged", "activations")


class MemoryRefused(Exception):
    """A reservation that would exceed capacity minus headroom."""


@dataclass(slots=True)
class StagedEntry:
    """Weights of one (tenant, segment) staged on a guest device."""

    nbytes: int
    last_used: float
    pins: int = 0  # active leases using it


class DeviceMemory:
    """Reservations on one device: never above ``limit = capacity - headroom``.

    Every change appends ``(time, used_bytes)`` to :attr:`timeline` (same-time changes are coalesced), so the
    memory of the device over time can be plotted and checked, not only its peak.
    """

    __slots__ = ("capacity", "limit", "used", "by_kind", "peak", "timeline", "staged")

    def __init__(self, capacity: int, headroom_fraction: float) -> None:
        self.capacity = int(capacity)
        self.limit = int(capacity * (1.0 - headroom_fraction))
        self.used = 0
        self.by_kind = {k: 0 for k in KINDS}
        self.peak = 0
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.staged: dict[tuple[str, str], StagedEntry] = {}

    @property
    def free(self) -> int:
        return self.limit - self.used

    def _record(self, now: float) -> None:
        tl = self.timeline
        if tl[-1][0] == now:
            tl[-1] = (now, self.used)
        else:
            tl.append((now, self.used))
        if self.used > self.peak:
            self.peak = self.used

    def try_alloc(self, kind: str, nbytes: int, now: float) -> bool:
        """Reserve ``nbytes`` of ``kind`` if it fits; returns False (and changes nothing) otherwise."""
        if nbytes > self.limit - self.used:
            return False
        self.used += nbytes
        self.by_kind[kind] += nbytes
        self._record(now)
        return True

    def alloc(self, kind: str, nbytes: int, now: float) -> None:
        """Reserve or raise :class:`MemoryRefused`."""
        if not self.try_alloc(kind, nbytes, now):
            raise MemoryRefused(f"{nbytes} B of {kind} does not fit: used {self.used} of limit {self.limit}")

    def release(self, kind: str, nbytes: int, now: float) -> None:
        """Return a reservation."""
        self.used -= nbytes
        self.by_kind[kind] -= nbytes
        self._record(now)

    # ---------------------------------------------------------------- staged weights (LRU, pinned by leases)
    def staged_bytes(self, tenant: str, segments: tuple[str, ...]) -> int:
        """Bytes of ``segments`` of ``tenant`` already resident here."""
        return sum(self.staged[(tenant, s)].nbytes for s in segments if (tenant, s) in self.staged)

    def stage(self, tenant: str, segment: str, nbytes: int, now: float) -> bool:
        """Make one segment resident (reserving memory unless it already is) and pin it."""
        e = self.staged.get((tenant, segment))
        if e is None:
            if not self.try_alloc("staged", nbytes, now):
                return False
            e = self.staged[(tenant, segment)] = StagedEntry(nbytes, now)
        e.pins += 1
        e.last_used = now
        return True

    def unpin(self, tenant: str, segment: str, now: float) -> None:
        """A lease stopped using a staged segment; it stays cached until memory is needed."""
        e = self.staged.get((tenant, segment))
        if e is not None:
            e.pins = max(0, e.pins - 1)
            e.last_used = now

    def evictable(self) -> int:
        """Bytes of staged weights that no active lease pins."""
        return sum(e.nbytes for e in self.staged.values() if e.pins == 0)

    def make_room(self, nbytes: int, now: float) -> bool:
        """Evict unpinned staged weights, least recently used first, until ``nbytes`` fit; True if they do."""
        if nbytes <= self.free:
            return True
        if nbytes > self.free + self.evictable():
            return False
        for key, e in sorted(self.staged.items(), key=lambda kv: kv[1].last_used):
            if e.pins:
                continue
            del self.staged[key]
            self.release("staged", e.nbytes, now)
            if nbytes <= self.free:
                return True
        return nbytes <= self.free
