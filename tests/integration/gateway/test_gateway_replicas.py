"""Gateway replicas share the tenant bounds (services/gateway/quota_store.py): three gateway instances on one Redis
(a single server, and a 3-master cluster) give a tenant its concurrency quota, its tokens-per-minute quota and the
global in-flight bound once, not three times; a dead gateway's counts stop counting when its lease ends."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway_harness import KEY_A, KEY_Q, TENANTS, Responder, make_gateway
from services.gateway.quota_store import QuotaStore, Refusal
from shared.config import parse_tenants
from support.redis_kinds import redis_url  # noqa: F401  (single server and cluster)
from support.wait import until

pytestmark = pytest.mark.integration
C = "/v1/completions"


async def _post(port: int, body: dict, key: str = KEY_Q) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}{C}", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.json()


async def _replicas(redis_url, prefix, n=3, **limits):
    gws = [make_gateway(redis_url, prefix, **limits) for _ in range(n)]
    for g in gws:
        await g.start()
    responder, stop = Responder(redis_url, prefix), asyncio.Event()
    task = asyncio.create_task(responder.run(stop))
    gws[0].responder = responder
    for _ in range(2):  # a renewal after every replica's first: each knows it is not alone (the loop: <= 1 s)
        for g in gws:
            await g.quota.renew()
    assert not any(g.quota.alone for g in gws)

    async def close():
        stop.set()
        for g in gws:
            await g.stop()
        await task

    return gws, close


async def test_three_gateways_share_the_concurrency_quota(redis, redis_url, prefix):
    gws, close = await _replicas(redis_url, prefix)
    try:  # tq: max_concurrency 2
        holds = [asyncio.create_task(_post(g.port, {"model": "tq", "prompt": "SLOW", "max_tokens": 10}))
                 for g in gws[:2]]
        assert await until(lambda: len(gws[0].responder.requests) == 2, 20.0, 0.01)  # both counted and enqueued
        st, body = await _post(gws[2].port, {"model": "tq", "prompt": "x", "max_tokens": 1})
        assert st == 429 and body["error"]["code"] == "concurrency_quota_exceeded", body
        assert "across the gateways" in body["error"]["message"]
        assert [s for s, _ in await asyncio.gather(*holds)] == [200, 200]
        assert await until(lambda: not any(g.quota._tasks for g in gws), 20.0, 0.01)  # releases go in the background
        st, _ = await _post(gws[2].port, {"model": "tq", "prompt": "x", "max_tokens": 1})
        assert st == 200
    finally:
        await close()


async def test_three_gateways_share_the_tokens_quota(redis, redis_url, prefix):
    gws, close = await _replicas(redis_url, prefix)
    try:  # tq: 400 tokens a minute; each request costs BOS + 9 prompt bytes + 100 = 110 tokens
        codes = []
        for i in range(9):  # round robin: one gateway alone would take 3 of them, three would take 9
            st, body = await _post(gws[i % 3].port, {"model": "tq", "prompt": "123456789", "max_tokens": 100})
            codes.append(st if st == 200 else body["error"]["code"])
        assert codes == [200] * 3 + ["tokens_quota_exceeded"] * 6, codes
    finally:
        await close()


async def test_the_global_bound_holds_across_gateways(redis, redis_url, prefix):
    gws, close = await _replicas(redis_url, prefix, max_inflight=2)
    try:
        holds = [asyncio.create_task(_post(g.port, {"model": "ta", "prompt": "SLOW", "max_tokens": 10}, KEY_A))
                 for g in gws[:2]]
        assert await until(lambda: len(gws[0].responder.requests) == 2, 20.0, 0.01)
        st, body = await _post(gws[2].port, {"model": "ta", "prompt": "x", "max_tokens": 1}, KEY_A)
        assert st == 503 and body["error"]["code"] == "overloaded", body
        assert [s for s, _ in await asyncio.gather(*holds)] == [200, 200]
    finally:
        await close()


async def test_a_dead_gateways_counts_expire_and_releases_are_idempotent(redis, prefix):
    tq = parse_tenants(TENANTS).get("tq")  # max_concurrency 2
    a = QuotaStore(redis, prefix, "gw-a", max_inflight=100, timeout_s=2.0, lease_ms=600)
    b = QuotaStore(redis, prefix, "gw-b", max_inflight=100, timeout_s=2.0, lease_ms=600)
    assert await a.admit(tq, "r1", 1) is None and await a.admit(tq, "r2", 1) is None
    assert await a.admit(tq, "r2", 1) is None  # the same request again (a retried call) counts once
    refused = await b.admit(tq, "r3", 1)
    assert isinstance(refused, Refusal) and (refused.reason, refused.count) == ("concurrency", 2)
    await asyncio.sleep(0.8)  # gw-a died: no renewal, its lease ends and its counts stop counting
    assert await b.admit(tq, "r4", 1) is None
    for _ in range(3):  # a retried release counts once
        b.release("tq", "r4")
    await asyncio.gather(*b._tasks)
    assert await b.admit(tq, "r5", 1) is None and await b.admit(tq, "r6", 1) is None
    assert isinstance(await b.admit(tq, "r7", 1), Refusal)
    b.release("tq", "r8")  # a release before its admission (which timed out at the gateway) reached Redis
    await asyncio.gather(*b._tasks)
    b.release("tq", "r6")
    await asyncio.gather(*b._tasks)
    assert isinstance(await b.admit(tq, "r8", 1), Refusal)  # the late admission counts nothing
    assert await b.admit(tq, "r9", 1) is None  # r6's slot is free


async def test_a_gateway_alone_counts_in_the_background_and_a_new_replica_sees_it(redis, prefix):
    tq = parse_tenants(TENANTS).get("tq")  # max_concurrency 2
    a = QuotaStore(redis, prefix, "gw-a", max_inflight=100, timeout_s=2.0)
    await a.renew()
    assert a.alone  # the only live gateway: its local checks decide, Redis is told off the request's path
    for rid in ("r1", "r2"):
        assert await a.admit(tq, rid, 1) is None
    await asyncio.gather(*a._tasks)
    b = QuotaStore(redis, prefix, "gw-b", max_inflight=100, timeout_s=2.0)
    await b.renew()
    assert not b.alone
    refused = await b.admit(tq, "r3", 1)  # a's two requests are counted
    assert isinstance(refused, Refusal) and refused.count == 2
    await a.renew()
    assert not a.alone  # a learns of b at its next renewal and checks with Redis again
    assert isinstance(await a.admit(tq, "r4", 1), Refusal)
