"""Producers and consumers over Redis stream consumer groups.

Rules implemented here (DESIGN §7, RELIABILITY.md): groups created idempotently (BUSYGROUP ignored, NOGROUP
recreated); blocking reads on their own connection with a socket timeout above the block time; after any read error
the consumer re-reads its own pending list (id ``0``) before reading new entries (``>``); entries are acked only
after the handler's effect (or later, by the owner, for long-running work); a reclaim loop takes over a dead
consumer's entries with XAUTOCLAIM; entries that do not decode, or that failed ``max_deliveries`` times, go to the
dead-letter stream with the reason and are acked; trimming never goes below the oldest pending entry.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from shared.codec import DecodeError, decode, encode
from shared.redis_util import REDIS_ERRORS, run_pipeline

log = structlog.get_logger()

ACK = "ack"  # handler results
DEFER = "defer"  # keep pending: the owner acks later (long-running work)

FIELD_TYPE = b"t"
FIELD_MSG = b"m"


class StreamProducer:
    """XADD of typed messages; ``maxlen`` only for streams without groups that must stay bounded.

    ``durable=True`` (a message that hands a request on, whose sender then forgets it): on a Redis Cluster the call
    returns only after a replica of the stream's master has the entry too (``WAIT``, :func:`run_pipeline`), so a
    failover cannot lose it."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def add(self, stream: str, msg: msgspec.Struct, *, maxlen: int | None = None, durable: bool = False) -> str:
        fields = {FIELD_TYPE: type(msg).__name__, FIELD_MSG: encode(msg)}
        if durable:
            entry_id = (await run_pipeline(self.redis, lambda p: p.xadd(stream, fields, maxlen=maxlen,
                                                                        approximate=True), replicate=[stream]))[0]
        else:
            entry_id = await self.redis.xadd(stream, fields, maxlen=maxlen, approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    async def add_many(self, items: list[tuple[str, msgspec.Struct]], *, maxlen: int | None = None,
                       durable: bool = False) -> None:
        """Several XADDs in one round trip (not atomic)."""
        if not items:
            return

        def build(pipe) -> None:
            for stream, msg in items:
                pipe.xadd(stream, {FIELD_TYPE: type(msg).__name__, FIELD_MSG: encode(msg)}, maxlen=maxlen,
                          approximate=True)

        await run_pipeline(self.redis, build, replicate=[s for s, _ in items] if durable else ())


def entry_payload(fields: dict) -> bytes | None:
    return fields.get(FIELD_MSG) if fields else None


@dataclass
class Delivery:
    """One delivered entry handed to a handler."""

    stream: str
    entry_id: str
    msg: Any
    reclaimed: bool = False


Handler = Callable[[Delivery], Awaitable[str | None]]
DeadCallback = Callable[[str, str, bytes | None, str], Awaitable[None]]  # stream, entry_id, raw, reason


async def ensure_group(redis: aioredis.Redis, stream: str, group: str, start: str = "0") -> None:
    try:
        await redis.xgroup_create(stream, group, id=start, mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class StreamConsumer:
    """Reads one stream as ``consumer`` in ``group`` and dispatches decoded messages to ``handler``.

    ``handler`` returns ``ACK`` (acked with the rest of its read batch, one XACK per batch, once every entry of
    the batch was handled) or ``DEFER`` (the owner calls :meth:`ack` later); raising counts as a
    failed delivery, retried from the pending list until ``max_deliveries``, then dead-lettered.

    ``noack=True`` reads new entries with XREADGROUP NOACK: they never enter the pending list, so one round trip
    less per entry, and an entry whose consumer dies before handling it is lost. Only for requests that are
    worthless after a short deadline (what-if queries): re-delivering them later helps nobody. Entries already
    pending (from a run without it) are still handled and acked.
    """

    def __init__(self, *, cmd: aioredis.Redis, blocking: aioredis.Redis, stream: str, group: str, consumer: str,
                 types: Any, handler: Handler, dead_stream: str, on_dead: DeadCallback | None = None,
                 block_ms: int = 1000, count: int = 64, max_deliveries: int = 5, min_idle_ms: int = 30_000,
                 reclaim_interval_s: float = 5.0, trim_interval_s: float = 30.0, noack: bool = False) -> None:
        self.cmd, self.blocking = cmd, blocking
        self.stream, self.group, self.consumer = stream, group, consumer
        self.types, self.handler = types, handler
        self.dead_stream, self.on_dead = dead_stream, on_dead
        self.block_ms, self.count, self.max_deliveries = block_ms, count, max_deliveries
        self.min_idle_ms, self.reclaim_interval_s, self.trim_interval_s = min_idle_ms, reclaim_interval_s, trim_interval_s
        self.noack = noack
        self.handled = 0
        self.dead_lettered = 0
        self.read_errors = 0

    # ------------------------------------------------------------ public
    async def ensure_group(self) -> None:
        await ensure_group(self.cmd, self.stream, self.group)

    async def ack(self, *entry_ids: str) -> None:
        await self.cmd.xack(self.stream, self.group, *entry_ids)

    async def run(self, stop: asyncio.Event, max_messages: int | None = None) -> None:
        """Consume until ``stop`` is set (or ``max_messages`` were handled): PEL first, then new entries."""
        await self._retry_forever(self.ensure_group, stop)
        read_pending, cursor = True, "0"
        while not stop.is_set():
            if max_messages is not None and self.handled >= max_messages:
                return
            try:
                start = cursor if read_pending else ">"
                pending = read_pending or not self.noack  # NOACK entries never enter the pending list
                resp = await self.blocking.xreadgroup(self.group, self.consumer, {self.stream: start},
                                                      count=self.count, block=None if read_pending else self.block_ms,
                                                      noack=not pending)
                entries = resp[0][1] if resp else []
                if read_pending:
                    # page through our own PEL; a short page means we reached its end
                    if len(entries) < self.count:
                        read_pending = False
                    if entries:
                        cursor = _s(entries[-1][0])
                    entries = [(i, f) for i, f in entries if f]  # trimmed-while-pending entries have no fields
                await self._dispatch_batch(entries, reclaimed=False, ack=pending, stop=stop)
            except ResponseError as e:
                if "NOGROUP" in str(e):
                    log.warning("stream_group_missing", stream=self.stream, group=self.group)
                    await self._retry_forever(self.ensure_group, stop)
                    read_pending, cursor = True, "0"
                else:
                    self.read_errors += 1
                    log.error("stream_read_failed", stream=self.stream, error=str(e))
                    await _sleep(stop, 0.5)
            except REDIS_ERRORS as e:
                self.read_errors += 1
                log.warning("stream_read_error", stream=self.stream, error=repr(e))
                read_pending, cursor = True, "0"
                await _sleep(stop, 0.5)

    async def reclaim_loop(self, stop: asyncio.Event) -> None:
        """Take over entries another consumer left idle for ``min_idle_ms`` (it died), and trim acked entries."""
        last_trim = 0.0
        while not stop.is_set():
            await _sleep(stop, self.reclaim_interval_s)
            if stop.is_set():
                return
            try:
                await self.reclaim_once()
                if time.monotonic() - last_trim > self.trim_interval_s:
                    await safe_trim(self.cmd, self.stream)
                    last_trim = time.monotonic()
            except REDIS_ERRORS as e:
                log.warning("stream_reclaim_error", stream=self.stream, error=repr(e))
            except ResponseError as e:
                log.warning("stream_reclaim_failed", stream=self.stream, error=str(e))

    async def reclaim_once(self) -> int:
        n, cursor = 0, "0-0"
        while True:
            res = await self.cmd.xautoclaim(self.stream, self.group, self.consumer, self.min_idle_ms,
                                            start_id=cursor, count=self.count)
            cursor, entries = res[0], res[1]
            deleted = res[2] if len(res) > 2 else []
            for d in deleted:
                log.error("stream_pending_entry_deleted", stream=self.stream, entry_id=_s(d))
            n += len(entries)
            await self._dispatch_batch(entries, reclaimed=True, ack=True)
            if _s(cursor) == "0-0" or not entries:
                return n

    # ------------------------------------------------------------ internals
    async def _dispatch_batch(self, entries: list, *, reclaimed: bool, ack: bool,
                              stop: asyncio.Event | None = None) -> None:
        """Handle one read's entries in order (until ``stop``), then ack the handled ones with one XACK: a round
        trip per read, not per entry. ``ack`` False: entries read with NOACK, nothing to ack."""
        acks: list[str] = []
        try:
            for entry_id, fields in entries:
                if stop is not None and stop.is_set():
                    break
                if await self._dispatch(entry_id, fields, reclaimed=reclaimed) and ack:
                    acks.append(_s(entry_id))
        finally:
            if acks:
                await self.ack(*acks)

    async def _dispatch(self, entry_id: Any, fields: dict, *, reclaimed: bool) -> bool:
        """Handle one entry; True when the caller should ack it (handled, and the handler did not defer)."""
        eid = _s(entry_id)
        raw = entry_payload(fields)
        if raw is None:
            # an entry trimmed away while pending, or written without our fields
            await self._dead(eid, raw, "entry has no payload field")
            return False
        try:
            msg = decode(raw, self.types)
        except DecodeError as e:
            await self._dead(eid, raw, f"undecodable: {e}")
            return False
        delivery = Delivery(self.stream, eid, msg, reclaimed)
        for attempt in range(1, self.max_deliveries + 1):
            try:
                result = await self.handler(delivery)
                break
            except (asyncio.CancelledError, *REDIS_ERRORS):
                raise  # Redis trouble: the entry stays pending and is re-read after reconnecting
            except Exception as e:  # the guard: one bad entry never kills the consumer
                log.exception("stream_handler_failed", stream=self.stream, entry_id=eid, attempt=attempt,
                              msg_type=type(msg).__name__)
                if attempt == self.max_deliveries:
                    await self._dead(eid, raw, f"handler failed {attempt} times: {e!r}")
                    return False
                await asyncio.sleep(0.02 * 2**attempt)
        self.handled += 1
        return result != DEFER

    async def _dead(self, entry_id: str, raw: bytes | None, reason: str) -> None:
        self.dead_lettered += 1
        log.warning("stream_dead_letter", stream=self.stream, entry_id=entry_id, reason=reason[:200])
        body = raw if raw is not None and len(raw) <= 64 * 1024 else (raw[:64 * 1024] if raw else b"")
        await self.cmd.xadd(self.dead_stream, {b"stream": self.stream, b"entry_id": entry_id, b"group": self.group,
                                               b"reason": reason[:1000], b"m": body, b"ts": str(time.time())},
                            maxlen=100_000, approximate=True)
        await self.ack(entry_id)
        if self.on_dead is not None:
            try:
                await self.on_dead(self.stream, entry_id, raw, reason)
            except Exception:
                log.exception("stream_on_dead_failed", stream=self.stream, entry_id=entry_id)

    async def _retry_forever(self, fn: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
        delay = 0.1
        while not stop.is_set():
            try:
                await fn()
                return
            except REDIS_ERRORS as e:
                log.warning("redis_unavailable", stream=self.stream, error=repr(e))
                await _sleep(stop, delay)
                delay = min(delay * 2, 2.0)


async def safe_trim(redis: aioredis.Redis, stream: str) -> None:
    """XTRIM MINID below every group's oldest pending entry and last delivered id: never drops unread work."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        return
    if not groups:
        return
    floor = None
    for g in groups:
        cand = _s(g.get("last-delivered-id") or g.get(b"last-delivered-id") or "0-0")
        pending = int(g.get("pending") or g.get(b"pending") or 0)
        if pending:
            summary = await redis.xpending(stream, _s(g.get("name") or g.get(b"name")))
            low = _s(summary.get("min")) if summary and summary.get("min") else cand
            cand = min(cand, low, key=_id_key)
        floor = cand if floor is None else min(floor, cand, key=_id_key)
    if floor and floor != "0-0":
        await redis.xtrim(stream, minid=floor, approximate=True)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


async def pace(stop: asyncio.Event, started: float, min_interval_s: float) -> None:
    """Wait until ``min_interval_s`` after ``started`` (a ``time.monotonic()`` reading), or until ``stop``: spaces
    out the reads of a follower loop so that a burst of entries is taken in a few reads."""
    left = started + min_interval_s - time.monotonic()
    if left > 0 and not stop.is_set():
        await _sleep(stop, left)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
