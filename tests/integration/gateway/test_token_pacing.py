"""The gateway's tokens stream read at most once per interval while it is busy (``SLICESCHED_STREAM_INTERVAL_MS``),
against a real Redis: every chunk arrives, in order; a busy stream (several entries per step) is read in fewer reads
than without pacing; a stream of one entry at a time is read after every entry (no added delay)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.tokens import TokenRouter
from shared.codec import encode
from shared.messages import TokenChunk
from shared.redis_util import blocking_client
from shared.streams import FIELD_MSG, FIELD_TYPE

STEPS = 12
SPACING_S = 0.02
SPAN_S = STEPS * SPACING_S


async def _deliver(redis, redis_url: str, stream: str, interval_s: float, requests: int) -> tuple[int, float]:
    """Append one chunk per request every SPACING_S (all of a step in one transaction, as a worker's step lands);
    returns (reads, seconds until the last chunk was routed)."""
    blk = blocking_client(redis_url, block_ms=200)
    r = TokenRouter(cmd=redis, blocking=blk, stream=stream, block_ms=200, read_interval_s=interval_s)
    rids = [f"r{i}" for i in range(requests)]
    pend = {rid: r.register(rid, "ta") for rid in rids}
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop))
    try:
        t0 = time.monotonic()
        for seq in range(STEPS):
            pipe = redis.pipeline(transaction=True)
            for rid in rids:
                c = TokenChunk(msg_id=f"{rid}-{seq}", request_id=rid, tenant="ta", seq=seq, token_ids=[seq], text="x")
                pipe.xadd(stream, {FIELD_TYPE: b"TokenChunk", FIELD_MSG: encode(c)})
            await pipe.execute()
            await asyncio.sleep(SPACING_S)
        for rid in rids:
            got = [(await asyncio.wait_for(pend[rid].queue.get(), timeout=5)).seq for _ in range(STEPS)]
            assert got == list(range(STEPS)), (rid, got)
        return r.reads, time.monotonic() - t0
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await blk.aclose()


async def test_busy_stream_is_read_once_per_interval(redis, redis_url, prefix):
    reads, took = await _deliver(redis, redis_url, f"{prefix}tokens:g", 0.1, requests=3)
    assert reads <= SPAN_S / 0.1 + 2, reads  # one read per interval at most (plus the first, at the first entry)
    assert took < SPAN_S + 0.1 + 1.0  # the last chunks waited at most about one interval


@pytest.mark.parametrize("interval_s,requests", [(0.0, 3), (0.1, 1)])
async def test_unpaced_or_single_entry_stream_is_read_per_append(redis, redis_url, prefix, interval_s, requests):
    reads, _took = await _deliver(redis, redis_url, f"{prefix}tokens:g", interval_s, requests=requests)
    assert reads > SPAN_S / 0.1 + 2, reads  # about one read per append
