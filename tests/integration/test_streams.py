"""Stream consumer behaviour against a real redis-server: ack after effect, reclaim, dead letters, idempotency."""
from __future__ import annotations

import asyncio

import pytest

from shared.codec import decode, encode
from shared.messages import (AssignRequest, CancelRequest, InferenceRequest, RequestError, RequestsMsg, TokenChunk,
                             WorkerHeartbeat, dead_stream, requests_stream)
from shared.redis_util import blocking_client
from shared.streams import ACK, StreamConsumer, StreamProducer, safe_trim
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)
from support.wait import until

pytestmark = pytest.mark.integration


def _req(i: int) -> InferenceRequest:
    return InferenceRequest(msg_id=f"m{i}", request_id=f"r{i}", tenant="t", gateway="g", prompt_ids=[1, 2, 3],
                            max_tokens=4)


def test_every_message_round_trips():
    req = _req(1)
    msgs = [req, CancelRequest(msg_id="c", request_id="r", tenant="t"),
            AssignRequest(msg_id="a", request=req, device="d", kv_blocks=3),
            TokenChunk(msg_id="k", request_id="r", tenant="t", seq=0, token_ids=[5], text="x"),
            RequestError(msg_id="e", request_id="r", tenant="t", status=503, code="c", message="m"),
            WorkerHeartbeat(msg_id="h", device="d", worker_id="w", backend="cpu", home_tenant="t", ts=1.0)]
    for m in msgs:
        assert decode(encode(m), type(m)) == m


def _consumer(redis, url, prefix, name, handler, **kw):
    return StreamConsumer(cmd=redis, blocking=blocking_client(url, block_ms=200), stream=requests_stream(prefix),
                          group="g", consumer=name, types=RequestsMsg, handler=handler,
                          dead_stream=dead_stream(prefix), block_ms=200, **kw)


async def _fill(redis, prefix: str, n: int) -> str:
    """The requests stream with requests r0 .. r{n-1} in it."""
    stream, prod = requests_stream(prefix), StreamProducer(redis)
    for i in range(n):
        await prod.add(stream, _req(i))
    return stream


def _record_acks(c: StreamConsumer) -> list[tuple[str, ...]]:
    """Wrap ``c.ack``: the returned list gets the entry ids of every XACK the consumer sends."""
    calls: list[tuple[str, ...]] = []
    orig = c.ack

    async def recording_ack(*entry_ids: str) -> None:
        calls.append(entry_ids)
        await orig(*entry_ids)

    c.ack = recording_ack
    return calls


async def test_dead_consumer_entries_are_reclaimed(redis, redis_url, prefix):
    prod = StreamProducer(redis)
    stream = requests_stream(prefix)
    for i in range(3):
        await prod.add(stream, _req(i))
    # consumer A reads the entries and dies before acking (simulated by reading without handling)
    a = blocking_client(redis_url, block_ms=200)
    await redis.xgroup_create(stream, "g", id="0", mkstream=True)
    got = await a.xreadgroup("g", "A", {stream: ">"}, count=10)
    assert len(got[0][1]) == 3
    await a.aclose()
    seen = []

    async def handler(d):
        seen.append(d.msg.request_id)
        return ACK

    b = _consumer(redis, redis_url, prefix, "B", handler, min_idle_ms=0)
    assert await b.reclaim_once() == 3
    assert sorted(seen) == ["r0", "r1", "r2"]
    assert (await redis.xpending(stream, "g"))["pending"] == 0
    await b.blocking.aclose()


async def test_poison_and_failing_entries_go_to_dead_letter(redis, redis_url, prefix):
    stream = requests_stream(prefix)
    await redis.xadd(stream, {b"t": b"InferenceRequest", b"m": b"\x93\x01"})  # truncated msgpack
    await redis.xadd(stream, {b"t": b"x", b"m": b"\x81\xa4type\xa7Unknown"})  # wrong schema
    await StreamProducer(redis).add(stream, _req(7))
    dead_seen = []

    async def handler(d):
        raise RuntimeError("boom")

    async def on_dead(stream_, entry_id, raw, reason):
        dead_seen.append(reason)

    c = _consumer(redis, redis_url, prefix, "A", handler, on_dead=on_dead, max_deliveries=2)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    for _ in range(100):
        if len(dead_seen) == 3:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert len(dead_seen) == 3
    assert sum("undecodable" in r for r in dead_seen) == 2
    assert await redis.xlen(dead_stream(prefix)) == 3
    assert (await redis.xpending(stream, "g"))["pending"] == 0
    await c.blocking.aclose()


async def test_restart_rereads_own_pending_first(redis, redis_url, prefix):
    stream = await _fill(redis, prefix, 5)
    seen = []

    async def handler(d):
        seen.append(d.msg.request_id)
        return "defer" if len(seen) <= 5 else ACK  # first pass: keep everything pending

    c = _consumer(redis, redis_url, prefix, "A", handler, count=2)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    await until(lambda: len(seen) >= 5)  # a loaded runner (or a cluster rig) may take longer than a fixed sleep
    stop.set()
    await task
    assert seen == [f"r{i}" for i in range(5)]
    # "restart": a new consumer object with the same name sees its pending entries again, in order, paged
    c2 = _consumer(redis, redis_url, prefix, "A", handler, count=2)
    stop2 = asyncio.Event()
    task = asyncio.create_task(c2.run(stop2))
    await until(lambda: len(seen) >= 10)
    stop2.set()
    await task
    assert seen[5:] == [f"r{i}" for i in range(5)]
    assert (await redis.xpending(stream, "g"))["pending"] == 0
    await safe_trim(redis, stream)
    await c.blocking.aclose()
    await c2.blocking.aclose()


async def test_noack_consumer_leaves_nothing_pending_and_acks_old_pending(redis, redis_url, prefix):
    stream = requests_stream(prefix)
    prod = StreamProducer(redis)
    await prod.add(stream, _req(0))
    # an earlier run without NOACK read r0 and died before acking it
    await redis.xgroup_create(stream, "g", id="0", mkstream=True)
    a = blocking_client(redis_url, block_ms=200)
    await a.xreadgroup("g", "A", {stream: ">"}, count=10)
    await a.aclose()
    assert (await redis.xpending(stream, "g"))["pending"] == 1
    seen = []

    async def handler(d):
        seen.append(d.msg.request_id)
        return ACK

    c = _consumer(redis, redis_url, prefix, "A", handler, noack=True)
    calls = _record_acks(c)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    for i in range(1, 4):
        await prod.add(stream, _req(i))
    for _ in range(100):
        if len(seen) == 4:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await task
    assert seen == ["r0", "r1", "r2", "r3"]
    assert sum(len(x) for x in calls) == 1  # only the entry that was already pending: NOACK reads cost no XACK
    assert (await redis.xpending(stream, "g"))["pending"] == 0
    await c.blocking.aclose()


async def test_one_xack_per_read_batch_and_deferred_entries_stay_pending(redis, redis_url, prefix):
    stream = await _fill(redis, prefix, 6)
    seen = []

    async def handler(d):
        seen.append(d.msg.request_id)
        return "defer" if d.msg.request_id == "r3" else ACK

    c = _consumer(redis, redis_url, prefix, "A", handler)
    calls = _record_acks(c)
    stop = asyncio.Event()
    task = asyncio.create_task(c.run(stop))
    for _ in range(100):
        if len(seen) == 6 and calls:
            break
        await asyncio.sleep(0.02)
    stop.set()
    await task
    assert seen == [f"r{i}" for i in range(6)]
    assert len(calls) == 1 and len(calls[0]) == 5  # the five acked entries of the one read, in one XACK
    pending = await redis.xpending_range(stream, "g", min="-", max="+", count=10)
    assert len(pending) == 1  # the deferred entry waits for its owner's ack
    await c.ack(pending[0]["message_id"].decode())
    assert (await redis.xpending(stream, "g"))["pending"] == 0
    await c.blocking.aclose()
