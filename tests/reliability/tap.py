"""The harness's view from inside Redis: it follows the requests stream, the events stream and every tokens stream
(plain XREAD, no consumer group, so it takes nothing away from the services) and records, per request id:

* when it was enqueued, and under which client ``seed`` (accepted requests the client never heard back about);
* every terminal entry delivered toward its gateway (a final ``TokenChunk`` or a ``RequestError``): more than one
  is a duplicated result; token chunks after the first terminal entry are late (unfenced) writes;
* ``RequestStarted`` / ``RequestFinished`` events (re-executions).

Gateways trim their tokens stream up to what they have read every few seconds; the tap reads continuously and
counts what it could not see (``missed``) from the streams' ``entries-added`` counters. Each stream is read with its
own XREAD (concurrently), since on a Redis Cluster the streams live on different masters.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import redis.asyncio as aioredis

from shared.codec import DecodeError, decode
from shared.messages import (EventsMsg, InferenceRequest, RequestError, RequestFinished, RequestsMsg, RequestStarted,
                             TokenChunk, TokensMsg, events_stream, requests_stream)
from shared.redis_util import command_client
from shared.streams import entry_payload


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


class Tap:
    """Follows the mesh's streams from "now" while :meth:`run` is active."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.url, self.p = redis_url, prefix
        self.seed_to_rid: dict[int, str] = {}
        self.enqueued: dict[str, float] = {}  # request_id -> time.monotonic() first seen
        self.enqueue_count: Counter[str] = Counter()
        self.terminals: dict[str, list[tuple]] = defaultdict(list)  # rid -> [(kind, code, mono, msg_id)]
        self.late_chunks: Counter[str] = Counter()
        self.started: Counter[str] = Counter()
        self.started_at: dict[str, float] = {}  # rid -> wall time of the first RequestStarted
        self.finished: dict[str, list[str]] = defaultdict(list)
        self.read = Counter()
        self.errors = 0
        self._last: dict[str, str] = {}
        self._added0: dict[str, int] = {}

    # ------------------------------------------------------------ loop
    async def run(self, stop: asyncio.Event) -> None:
        r = command_client(self.url, socket_timeout_s=5, max_connections=256, name="reliability-tap")
        readers: dict[str, asyncio.Task] = {}
        try:
            while True:
                try:
                    await self._discover(r, initial=not readers and not self._last)
                except Exception:  # Redis down or restarting: keep trying, the row measures that
                    self.errors += 1
                for n in self._last:
                    if n not in readers:
                        readers[n] = asyncio.create_task(self._follow(r, n, stop))
                if stop.is_set():
                    break
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            await asyncio.gather(*readers.values(), return_exceptions=True)
            await r.aclose()

    async def _follow(self, r: aioredis.Redis, name: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                resp = await r.xread({name: self._last[name]}, count=1000, block=200)
            except Exception:  # Redis down or restarting: keep trying, the row measures that
                self.errors += 1
                await asyncio.sleep(0.2)
                continue
            for _stream, entries in resp or []:
                for eid, fields in entries:
                    self._last[name] = _s(eid)
                    self.read[name] += 1
                    self._handle(name, entry_payload(fields))

    async def _discover(self, r: aioredis.Redis, initial: bool = False) -> None:
        names = [requests_stream(self.p), events_stream(self.p)]
        names += [_s(k) async for k in r.scan_iter(match=f"{self.p}tokens:*", count=1000, _type="stream")]
        for n in names:
            if n in self._last:
                continue
            try:
                info = await r.xinfo_stream(n)
                last = _s(info.get("last-generated-id") or "0-0")
                self._added0[n] = int(info.get("entries-added") or 0) if initial else 0
            except Exception:  # the stream does not exist yet
                last = "0-0"
                self._added0[n] = 0
            # requests/events: only what happens from now on; tokens streams created later: from their start
            self._last[n] = last if initial else "0-0"

    def _handle(self, stream: str, raw: bytes | None) -> None:
        if raw is None:
            return
        now = time.monotonic()
        try:
            if stream.endswith(":requests"):
                msg = decode(raw, RequestsMsg)
                if isinstance(msg, InferenceRequest):
                    self.enqueue_count[msg.request_id] += 1
                    self.enqueued.setdefault(msg.request_id, now)
                    if msg.seed is not None:
                        self.seed_to_rid.setdefault(msg.seed, msg.request_id)
            elif stream.endswith(":events"):
                msg = decode(raw, EventsMsg)
                if isinstance(msg, RequestStarted):
                    self.started[msg.request_id] += 1
                    self.started_at.setdefault(msg.request_id, msg.ts)
                elif isinstance(msg, RequestFinished):
                    self.finished[msg.request_id].append(msg.outcome)
            else:
                msg = decode(raw, TokensMsg)
                rid = msg.request_id
                seen = {m for _, _, _, m in self.terminals.get(rid, ())}
                if msg.msg_id in seen:  # the same result re-sent (a retried publish): not a second result
                    return
                if isinstance(msg, RequestError):
                    self.terminals[rid].append(("error", msg.code, now, msg.msg_id))
                elif isinstance(msg, TokenChunk):
                    if seen:
                        self.late_chunks[rid] += 1
                    if msg.finish_reason is not None:
                        self.terminals[rid].append(("finish", msg.finish_reason, now, msg.msg_id))
        except DecodeError:
            pass  # poison entries injected by a row; the services' handling of them is what is measured

    # ------------------------------------------------------------ summaries
    async def missed(self) -> int:
        """Tokens-stream entries added while tapped that the tap never read (trimmed first, or stream reset)."""
        r = command_client(self.url, socket_timeout_s=5, name="reliability-tap")
        missed = 0
        try:
            for n in self._last:
                if ":tokens:" not in n:
                    continue
                try:
                    info = await r.xinfo_stream(n)
                except Exception:
                    continue
                added = int(info.get("entries-added") or 0) - self._added0.get(n, 0)
                missed += max(0, added - self.read[n])
        finally:
            await r.aclose()
        return missed

    def rid(self, seed: int) -> str | None:
        return self.seed_to_rid.get(seed)


async def with_tap(tap: Tap, coro):
    """Run ``coro`` while ``tap`` follows the streams; the tap keeps reading 1 s after it ends (late writes)."""
    stop = asyncio.Event()
    task = asyncio.create_task(tap.run(stop))
    await asyncio.sleep(0.3)
    try:
        return await coro
    finally:
        await asyncio.sleep(1.0)
        stop.set()
        await task
