"""Client of the simulator service's what-if RPC: ``await client.whatif(candidates, timeout_s)`` asks the twin of the
live mesh about candidate leases and admissions. Used by ``slicesched bench whatif`` and the integration tests;
the live scheduler does not call it (no service imports another, and a round trip does not fit its decision
budget): it takes what the simulator learned from the versioned ``sim:steering`` copy instead
(``services/scheduler/steering.py``, docs/simulator-service.md).

Queries go to ``sim:rpc``; each client reads its own reply stream ``sim:reply:{client}`` on a dedicated blocking
connection and matches replies to callers by ``query_id``. A query carries its deadline; the simulator drops
queries it reaches too late, and the caller gets :class:`WhatIfTimeout`.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis
import structlog

from shared.codec import DecodeError, decode
from shared.messages import SimReplyMsg, WhatIfCandidate, WhatIfQuery, WhatIfReply, sim_reply_stream, sim_rpc_stream
from shared.redis_util import REDIS_ERRORS, blocking_client
from shared.streams import StreamProducer, entry_payload

log = structlog.get_logger()

RPC_MAXLEN = 100_000  # far above any live backlog; entries that old are long past their deadline


class WhatIfTimeout(asyncio.TimeoutError):
    """No reply within the timeout (the simulator is down, overloaded, or the query was dropped late)."""


class WhatIfError(RuntimeError):
    """The simulator answered with an error (e.g. its twin is not ready, too many candidates)."""


class WhatIfClient:
    """One per process; safe for concurrent callers."""

    def __init__(self, redis: aioredis.Redis, redis_url: str, prefix: str, client_id: str | None = None,
                 *, block_ms: int = 1000) -> None:
        self.redis, self.prefix = redis, prefix
        self.client_id = client_id or f"c{uuid.uuid4().hex[:12]}"
        self.stream = sim_reply_stream(prefix, self.client_id)
        self.block_ms = block_ms
        self._blocking = blocking_client(redis_url, block_ms=block_ms, name=f"whatif-{self.client_id}")
        self._producer = StreamProducer(redis)
        self._waiters: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._pos = "0-0"
        self._closing = False

    async def start(self) -> "WhatIfClient":
        last = await self.redis.xrevrange(self.stream, "+", "-", count=1)
        self._pos = _s(last[0][0]) if last else "0-0"
        self._reader = asyncio.create_task(self._read_loop())
        return self

    async def close(self) -> None:
        self._closing = True  # redis-py may turn a cancelled read into a connection error: the loop checks this
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for f in self._waiters.values():
            if not f.done():
                f.cancel()
        try:
            await self.redis.delete(self.stream)
        except REDIS_ERRORS:
            pass
        await self._blocking.aclose()

    async def whatif(self, candidates: list[WhatIfCandidate], timeout_s: float = 0.05,
                     horizon_s: float = 2.0) -> WhatIfReply:
        """Evaluate ``candidates`` on the simulator's twin; raises WhatIfTimeout or WhatIfError."""
        if self._reader is None:
            await self.start()
        qid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self._waiters[qid] = fut
        q = WhatIfQuery(msg_id=qid, query_id=qid, client=self.client_id, candidates=list(candidates),
                        horizon_s=horizon_s, deadline_ts=time.time() + timeout_s)
        try:
            await self._producer.add(sim_rpc_stream(self.prefix), q, maxlen=RPC_MAXLEN)
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise WhatIfTimeout(f"no what-if reply within {timeout_s * 1e3:.0f} ms") from None
        finally:
            self._waiters.pop(qid, None)
        if reply.error:
            raise WhatIfError(reply.error)
        return reply

    async def _read_loop(self) -> None:
        while not self._closing:
            try:
                resp = await self._blocking.xread({self.stream: self._pos}, count=100, block=self.block_ms)
            except REDIS_ERRORS as e:
                if self._closing:
                    return
                log.warning("whatif_reply_read_error", error=repr(e))
                await asyncio.sleep(0.2)
                continue
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    self._pos = _s(entry_id)
                    raw = entry_payload(fields)
                    try:
                        reply = decode(raw, SimReplyMsg) if raw is not None else None
                    except DecodeError:
                        continue
                    fut = self._waiters.get(reply.query_id) if reply else None
                    if fut is not None and not fut.done():
                        fut.set_result(reply)


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
