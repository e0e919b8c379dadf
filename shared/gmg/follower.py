"""Follow the GMG: load a consistent snapshot of every GMG key, then replay the change stream from the snapshot's
position. Each change entry carries epoch ``e`` and the exact mutations that took the GMG from ``e - 1`` to ``e``;
a gap in epochs (the stream was trimmed past us, or written by an older release) makes the follower reload.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from shared.gmg.keys import GMGKeys
from shared.gmg.mutations import Mirror, ZSet, apply_mutation, decode_change
from shared.gmg.snapshot import GMGSnapshot
from shared.redis_util import REDIS_ERRORS
from shared.streams import pace

log = structlog.get_logger()

_HASH_KINDS = ("device", "reservations", "resident", "pins", "exec", "reqs")
_ZSET_KINDS = ("leases", "busy", "finished")


async def read_mirror(redis: aioredis.Redis, keys: GMGKeys, attempts: int = 20) -> tuple[Mirror, int, str]:
    """(mirror, epoch, last change-stream id) read in one MULTI, so the three agree."""
    for _ in range(attempts):
        pipe = redis.pipeline(transaction=False)
        pipe.smembers(keys.devices)
        pipe.smembers(keys.tenants)
        devs0, tens0 = await pipe.execute()
        devs, tens = sorted(_s(x) for x in devs0), sorted(_s(x) for x in tens0)
        pipe = redis.pipeline(transaction=False)
        for d in devs:
            pipe.zrange(keys.leases(d), 0, -1)
        lease_ids = {_s(x) for ids in (await pipe.execute() if devs else []) for x in ids}
        tx = redis.pipeline(transaction=True)
        tx.get(keys.epoch)
        tx.xrevrange(keys.changes, "+", "-", count=1)
        tx.smembers(keys.devices)
        tx.smembers(keys.tenants)
        plan: list[tuple[str, str]] = []
        for d in devs:
            for kind in _HASH_KINDS:
                key = _key(keys, kind, d)
                tx.hgetall(key)
                plan.append(("hash", key))
            for kind in _ZSET_KINDS:
                key = _key(keys, kind, d)
                tx.zrange(key, 0, -1, withscores=True)
                plan.append(("zset", key))
        for t in tens:
            tx.hgetall(keys.tenant(t))
            plan.append(("hash", keys.tenant(t)))
            tx.get(keys.model_graph(t))
            plan.append(("blob", keys.model_graph(t)))
        for lid in sorted(lease_ids):
            tx.hgetall(keys.lease(lid))
            plan.append(("hash", keys.lease(lid)))
        rows = await tx.execute()
        epoch, last, devs1, tens1 = int(rows[0] or 0), rows[1], rows[2], rows[3]
        if sorted(_s(x) for x in devs1) != devs or sorted(_s(x) for x in tens1) != tens:
            continue  # membership changed between the two reads: read again
        mirror: Mirror = {}
        if devs:
            mirror[keys.devices] = set(devs)
        if tens:
            mirror[keys.tenants] = set(tens)
        for (typ, key), v in zip(plan, rows[4:]):
            if typ == "hash" and v:
                mirror[key] = {_s(a): _s(b) for a, b in v.items()}
            elif typ == "zset" and v:
                mirror[key] = ZSet((_s(m), float(sc)) for m, sc in v)
            elif typ == "blob" and v is not None:
                mirror[key] = bytes(v)
        live_leases = {m for d in devs for m in mirror.get(keys.leases(d), {})}
        if not live_leases <= lease_ids:
            continue  # a lease was committed between the two reads
        return mirror, epoch, _s(last[0][0]) if last else "0-0"
    raise RuntimeError("could not read a consistent GMG snapshot (membership kept changing)")


def _key(keys: GMGKeys, kind: str, device: str) -> str:
    return {"device": keys.device, "reservations": keys.reservations, "resident": keys.resident, "pins": keys.pins,
            "exec": keys.exec_state, "reqs": keys.requests, "leases": keys.leases, "busy": keys.busy,
            "finished": keys.finished}[kind](device)


class GMGFollower:
    """Keeps a local copy of the GMG up to date; :attr:`snapshot` is the typed view at :attr:`epoch`."""

    def __init__(self, redis: aioredis.Redis, prefix: str, *, blocking: aioredis.Redis | None = None,
                 block_ms: int = 1000, on_change: Callable[[int, str, list], None] | None = None,
                 min_interval_s: float = 0.0) -> None:
        self.redis, self.blocking = redis, blocking or redis
        self.keys = GMGKeys(prefix)
        self.block_ms = block_ms
        # run(): reads start at least this far apart unless a read came back full, so a burst of changes is
        # taken in a few reads instead of one round trip per change (0: read again at once)
        self.min_interval_s = min_interval_s
        self.on_change = on_change
        self.mirror: Mirror = {}
        self.epoch = -1
        self.position = "0-0"
        self.reloads = 0
        self.applied = 0
        self._snap: GMGSnapshot | None = None
        self._parsed: dict = {}  # key -> parsed value, reused by the next snapshot when the key did not change
        self._dirty: set[str] | None = None  # keys changed since the last snapshot; None = parse everything

    @property
    def loaded(self) -> bool:
        return self.epoch >= 0

    async def load(self) -> None:
        """Replace the local copy with a fresh snapshot from Redis."""
        self.mirror, self.epoch, self.position = await read_mirror(self.redis, self.keys)
        self.reloads += 1
        self._snap, self._dirty = None, None

    @property
    def snapshot(self) -> GMGSnapshot:
        """Typed view of the local copy (rebuilt only when the epoch moved)."""
        if self._snap is None or self._snap.epoch != self.epoch:
            self._snap = GMGSnapshot.from_mirror(self.keys, self.mirror, self.epoch, cache=self._parsed,
                                                 dirty=self._dirty)
            self._dirty = set()
        return self._snap

    def apply_entry(self, entry_id: str, fields: dict) -> bool:
        """Apply one change entry; False when it reveals a gap (the caller reloads)."""
        epoch, op, muts = decode_change(fields)
        self.position = entry_id
        if epoch <= self.epoch:
            return True  # already in the snapshot
        if epoch != self.epoch + 1:
            log.warning("gmg_follower_gap", have=self.epoch, got=epoch)
            return False
        for cmd, key, args in muts:
            apply_mutation(self.mirror, cmd, key, args)
            if self._dirty is not None:
                self._dirty.add(key)
        self.epoch = epoch
        self.applied += 1
        if self.on_change is not None:
            self.on_change(epoch, op, muts)
        return True

    async def poll(self, block_ms: int | None = None, count: int = 500) -> int:
        """Read and apply the entries after our position (blocking up to ``block_ms``); returns how many."""
        if not self.loaded:
            await self.load()
        client = self.blocking if block_ms else self.redis
        resp = await client.xread({self.keys.changes: self.position}, count=count, block=block_ms or None)
        n = 0
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                if not self.apply_entry(_s(entry_id), fields):
                    await self.load()
                    return n
                n += 1
        return n

    async def catch_up(self) -> int:
        """Apply everything written so far (non-blocking)."""
        total = 0
        while True:
            n = await self.poll(None)
            total += n
            if n == 0:
                return total

    async def run(self, stop: asyncio.Event) -> None:
        """Follow until ``stop``; reloads after Redis errors (the stream may have restarted without history)."""
        polls, count = 0, 500
        while not stop.is_set():
            try:
                started = time.monotonic()
                if await self.poll(self.block_ms, count) < count:
                    await pace(stop, started, self.min_interval_s)
                polls += 1
                if polls % 20 == 0 and int(await self.redis.get(self.keys.epoch) or 0) < self.epoch:
                    log.warning("gmg_follower_epoch_went_back", have=self.epoch)
                    await self.load()  # Redis lost data (restart without persistence): start over
            except (ResponseError, *REDIS_ERRORS) as e:
                log.warning("gmg_follower_error", error=repr(e))
                self.epoch = -1
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
