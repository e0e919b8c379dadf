"""The gateway's tokens stream read at most once per interval (``SLICESCHED_STREAM_INTERVAL_MS``), against a real
Redis: every chunk arrives, in order, in fewer reads than without pacing."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.tokens import TokenRouter
from shared.codec import encode
from shared.messages import TokenChunk
from shared.redis_util import blocking_client
from shared.streams import FIELD_MSG, FIELD_TYPE

CHUNKS = 12
SPACING_S = 0.02


async def _deliver(redis, redis_url: str, stream: str, interval_s: float) -> tuple[int, list[int], float]:
    """Append CHUNKS chunks SPACING_S apart; returns (reads, seqs received, seconds until the last arrived)."""
    blk = blocking_client(redis_url, block_ms=200)
    r = TokenRouter(cmd=redis, blocking=blk, stream=stream, block_ms=200, read_interval_s=interval_s)
    p = r.register("r1", "ta")
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop))
    got: list[int] = []
    try:
        t0 = time.monotonic()
        for seq in range(CHUNKS):
            c = TokenChunk(msg_id=f"m{seq}", request_id="r1", tenant="ta", seq=seq, token_ids=[seq], text="x")
            await redis.xadd(stream, {FIELD_TYPE: b"TokenChunk", FIELD_MSG: encode(c)})
            await asyncio.sleep(SPACING_S)
        while len(got) < CHUNKS:
            got.append((await asyncio.wait_for(p.queue.get(), timeout=5)).seq)
        return r.reads, got, time.monotonic() - t0
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        await blk.aclose()


@pytest.mark.parametrize("interval_s", [0.0, 0.1])
async def test_paced_reads_deliver_every_chunk_in_order(redis, redis_url, prefix, interval_s):
    reads, seqs, took = await _deliver(redis, redis_url, f"{prefix}tokens:g", interval_s)
    assert seqs == list(range(CHUNKS))
    span = CHUNKS * SPACING_S
    if interval_s:
        # one read per interval at most (plus the first, which returns at the first entry)
        assert reads <= span / interval_s + 2, reads
        assert took < span + interval_s + 1.0  # the last chunk waited at most about one interval
    else:
        assert reads > span / 0.1 + 2, reads  # unpaced, the router reads about once per append
