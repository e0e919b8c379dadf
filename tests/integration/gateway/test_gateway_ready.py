"""The gateway's ``/ready`` (readiness: a live worker for every tenant, as the scheduler reports it) against a real
redis-server, beside ``/health`` (liveness), which does not depend on workers."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import jsonschema

from services.gateway.openapi import openapi_document
from shared.requests_state import tenant_stats_key

READY = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/Readiness",
                                          "components": openapi_document()["components"]})


async def _get(url: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            return r.status, await r.json()


async def test_ready_names_the_tenants_that_cannot_be_served(gw, redis, prefix):
    deadline = time.monotonic() + 5
    while not gw.gateway.shell.redis_ok and time.monotonic() < deadline:  # first health beat
        await asyncio.sleep(0.05)
    assert (await _get(gw.url, "/health"))[0] == 200  # alive whatever the workers do
    status, body = await _get(gw.url, "/ready")
    READY.validate(body)
    assert status == 503 and body["status"] == "not_ready" and body["not_ready"] == ["ta", "tb", "tq"]
    assert "scheduler has not reported" in body["tenants"]["ta"]["reason"]

    now = time.time()
    for t, ts, up in (("ta", now, 1), ("tb", now, 0), ("tq", now - 10, 1)):
        await redis.hset(tenant_stats_key(prefix, t), mapping={"ts": ts, "homes_up": up, "homes": 1})
    status, body = await _get(gw.url, "/ready")
    READY.validate(body)
    assert status == 503 and body["not_ready"] == ["tb", "tq"] and body["tenants"]["ta"] == {"ready": True,
                                                                                          "reason": ""}
    assert body["tenants"]["tb"]["reason"] == "no live worker on its home devices (cpu1)"
    assert "last report is 10." in body["tenants"]["tq"]["reason"]

    for t in ("tb", "tq"):
        await redis.hset(tenant_stats_key(prefix, t), mapping={"ts": time.time(), "homes_up": 1})
    status, body = await _get(gw.url, "/ready")
    assert status == 200 and body["status"] == "ready" and body["not_ready"] == []

    gw.gateway.draining = True  # a stopping gateway takes no new requests: not ready, and says why
    status, body = await _get(gw.url, "/ready")
    gw.gateway.draining = False
    assert status == 503 and body["tenants"]["ta"]["reason"] == "the gateway is draining"
