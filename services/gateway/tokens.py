"""This gateway's tokens stream: one XREAD BLOCK loop that routes TokenChunk / RequestError entries to the
per-request queues of the requests this instance is serving.

The stream belongs to one gateway instance, so it is read without a consumer group: entries already read are
trimmed, and the stream gets a TTL so it disappears if the instance dies. Chunks are delivered in ``seq`` order;
duplicates (re-delivery, re-execution) are dropped; entries for unknown requests or from another tenant are ignored.

While the stream is busy it is read at most once per ``read_interval_s`` (``SLICESCHED_STREAM_INTERVAL_MS``,
default 10 ms): every worker step appends one entry per running request, and reading them one step at a time made
the gateway pay an XREAD, a wake-up of each request's handler and an SSE write per token. Paced, one read brings
the entries of several steps and each handler writes its request's tokens of the interval in one write
(docs/benchmarks.md). Busy means the last read brought more than one entry: a read after an idle period returns as
soon as the first entry arrives, and a stream that brings one entry at a time (one request streaming) is read
after every entry, so a quiet gateway adds no delay; a busy one delivers tokens up to one interval later than they
were appended.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import redis.asyncio as aioredis
import structlog

from shared.codec import DecodeError, decode
from shared.messages import RequestError, TokenChunk, TokensMsg
from shared.redis_util import REDIS_ERRORS
from shared.streams import entry_payload

log = structlog.get_logger()

READ_COUNT = 256  # entries per XREAD
PACE_MIN_ENTRIES = 2  # a read that brought fewer entries than this is not paced (the stream is not busy)
MAX_BUFFERED = 4096  # out-of-order chunks held per request before the request is failed
# A request's final chunk arrived but an earlier one is missing (lost with a Redis master that failed before its
# replica had it): after this long the request ends with a retryable 502 stream_gap instead of the idle timeout.
GAP_GRACE_S = 2.0
STREAM_TTL_S = 3600


@dataclass
class PendingRequest:
    """A request waiting for its tokens; the handler reads ``queue``."""

    request_id: str
    tenant: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    buffer: dict[int, TokenChunk] = field(default_factory=dict)
    on_chunk: Callable[[TokenChunk], None] | None = None  # sees each chunk as it is routed, in seq order


class TokenRouter:
    """Reads ``stream`` and hands each entry to the matching :class:`PendingRequest`."""

    def __init__(self, *, cmd: aioredis.Redis, blocking: aioredis.Redis, stream: str, block_ms: int = 1000,
                 fail_pending_after_s: float = 10.0, read_interval_s: float = 0.0) -> None:
        self.cmd, self.blocking, self.stream = cmd, blocking, stream
        self.block_ms = block_ms
        self.read_interval_s = read_interval_s
        self.reads = 0  # XREADs that returned entries
        self.fail_pending_after_s = fail_pending_after_s
        self.last_id = "0-0"
        self._pending: dict[str, PendingRequest] = {}
        self._gapped: dict[str, float] = {}  # request id -> when its final chunk arrived ahead of a missing one
        self.duplicates = self.unknown = self.foreign = self.undecodable = self.read_errors = 0

    # ------------------------------------------------------------ registry
    def register(self, request_id: str, tenant: str,
                 on_chunk: Callable[[TokenChunk], None] | None = None) -> PendingRequest:
        p = self._pending[request_id] = PendingRequest(request_id, tenant, on_chunk=on_chunk)
        return p

    def unregister(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._gapped.pop(request_id, None)

    def pending_count(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------ routing (no I/O)
    def dispatch(self, msg: TokenChunk | RequestError) -> None:
        p = self._pending.get(msg.request_id)
        if p is None:
            self.unknown += 1
            return
        if msg.tenant != p.tenant:  # a request id belongs to its tenant
            self.foreign += 1
            log.warning("token_entry_foreign_tenant", request_id=msg.request_id, entry_tenant=msg.tenant,
                        owner_tenant=p.tenant)
            return
        if isinstance(msg, RequestError):
            p.queue.put_nowait(msg)
            return
        if msg.seq < p.next_seq or msg.seq in p.buffer:
            self.duplicates += 1
            return
        if len(p.buffer) >= MAX_BUFFERED:
            log.error("token_gap_unfilled", request_id=p.request_id, expected_seq=p.next_seq)
            p.queue.put_nowait(RequestError(msg_id=f"gap-{p.request_id}", request_id=p.request_id, tenant=p.tenant,
                                            status=502, code="stream_gap",
                                            message="token chunks were lost between worker and gateway",
                                            retryable=True))
            return
        p.buffer[msg.seq] = msg
        while p.next_seq in p.buffer:
            chunk = p.buffer.pop(p.next_seq)
            p.queue.put_nowait(chunk)
            p.next_seq += 1
            if p.on_chunk is not None:
                p.on_chunk(chunk)
        if any(c.finish_reason is not None for c in p.buffer.values()):
            self._gapped.setdefault(p.request_id, time.monotonic())
        else:
            self._gapped.pop(p.request_id, None)

    def fail_gaps(self, now: float, grace_s: float = GAP_GRACE_S) -> int:
        """End requests whose final chunk has waited ``grace_s`` for a missing earlier one (502, retryable)."""
        failed = 0
        for rid, since in list(self._gapped.items()):
            p = self._pending.get(rid)
            if p is None or now - since < grace_s:
                continue
            del self._gapped[rid]
            log.error("token_gap_unfilled", request_id=rid, expected_seq=p.next_seq)
            p.queue.put_nowait(RequestError(msg_id=f"gap-{rid}", request_id=rid, tenant=p.tenant, status=502,
                                            code="stream_gap",
                                            message="token chunks were lost between worker and gateway; retry",
                                            retryable=True))
            failed += 1
        return failed

    def fail_all(self, status: int, code: str, message: str) -> None:
        """Deliver an error to every pending request (the stream cannot be read)."""
        for p in list(self._pending.values()):
            p.queue.put_nowait(RequestError(msg_id=f"fail-{p.request_id}", request_id=p.request_id, tenant=p.tenant,
                                            status=status, code=code, message=message, retryable=True))

    def handle_entry(self, entry_id: str, fields: dict) -> None:
        self.last_id = entry_id
        raw = entry_payload(fields)
        try:
            msg = decode(raw, TokensMsg) if raw is not None else None
        except DecodeError as e:
            msg = None
            log.warning("token_entry_undecodable", entry_id=entry_id, error=str(e)[:200])
        if msg is None:
            self.undecodable += 1
            return
        self.dispatch(msg)

    # ------------------------------------------------------------ loops
    async def run(self, stop: asyncio.Event) -> None:
        """XREAD BLOCK until ``stop``; on Redis trouble retry, and fail pending requests if it lasts."""
        failing_since: float | None = None
        while not stop.is_set():
            started = time.monotonic()
            try:
                resp = await self.blocking.xread({self.stream: self.last_id}, count=READ_COUNT, block=self.block_ms)
                failing_since = None
            except REDIS_ERRORS as e:
                if stop.is_set():
                    return
                self.read_errors += 1
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("tokens_read_error", stream=self.stream, error=repr(e))
                elif now - failing_since > self.fail_pending_after_s and self._pending:
                    log.error("tokens_stream_unreadable", stream=self.stream, pending=len(self._pending))
                    self.fail_all(503, "redis_unavailable", "the gateway lost its connection to Redis")
                    failing_since = now
                await _sleep(stop, 0.5)
                continue
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    try:
                        self.handle_entry(eid, fields)
                    except Exception:  # one bad entry never stops the loop
                        log.exception("token_entry_failed", entry_id=eid)
            if self._gapped:
                self.fail_gaps(time.monotonic())
            if resp:
                self.reads += 1
                wait = pace_delay(self.read_interval_s, started, time.monotonic(), resp)
                if wait > 0:
                    await _sleep(stop, wait)

    async def housekeeping_loop(self, stop: asyncio.Event, interval_s: float = 5.0) -> None:
        """Trim entries already read and keep a TTL on the stream (it dies with this instance)."""
        while not stop.is_set():
            await _sleep(stop, interval_s)
            try:
                pipe = self.cmd.pipeline(transaction=False)
                if self.last_id != "0-0":
                    pipe.xtrim(self.stream, minid=self.last_id, approximate=False)
                pipe.expire(self.stream, STREAM_TTL_S)
                await pipe.execute()
            except Exception as e:  # housekeeping is best effort (Redis down, a foreign key type, ...)
                log.debug("tokens_housekeeping_failed", error=repr(e))

    async def delete_stream(self) -> None:
        try:
            await self.cmd.delete(self.stream)
        except REDIS_ERRORS:
            pass


def pace_delay(interval_s: float, started: float, now: float, resp: list) -> float:
    """Seconds to wait before the next read so that reads start at most ``interval_s`` apart while the stream is
    busy; none after a read of a single entry (nothing to batch) or a full one (a backlog is read at once)."""
    n = sum(len(entries) for _stream, entries in resp)
    if interval_s <= 0 or n < PACE_MIN_ENTRIES or any(len(entries) >= READ_COUNT for _stream, entries in resp):
        return 0.0
    return max(0.0, interval_s - (now - started))


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
