"""A short smoke of the reliability harness on the launched mesh (~40 s, marked ``slow`` to keep the default suite
short; run it alone with ``pytest -m slow tests/reliability/test_smoke.py``): duplicated XADDs give one result each
(row 13), poison entries are dead-lettered and their requester told (row 12), and gateway traffic followed by the
tap is neither lost nor duplicated. The full rows are the other ``slow`` tests beside this file."""
from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from reliability.load import Driver
from reliability.results import RowResult, summarize
from reliability.rig import KEYS, Rig
from reliability.scenario import fake_request, poison_payloads, xadd_poison, xadd_requests
from reliability.tap import Tap
from shared.messages import dead_stream, requests_stream

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(180)]


async def test_harness_smoke_on_the_mesh(tmp_path):
    rig = await asyncio.to_thread(Rig.start, tmp_path)
    tap = Tap(rig.redis_url, rig.prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(tap.run(stop))
    try:
        await asyncio.sleep(0.3)
        r = rig.r()
        gw = f"smoke-{uuid.uuid4().hex[:6]}"
        dups = [fake_request(t, gw, max_tokens=2) for _ in range(10) for t in KEYS]
        await asyncio.to_thread(xadd_requests, r, rig.prefix, dups, copies=2)
        payloads = poison_payloads(gw, each=1, big_mb=1)
        dead_before = r.xlen(dead_stream(rig.prefix))
        await asyncio.to_thread(xadd_poison, r, requests_stream(rig.prefix), payloads)
        driver = Driver(rig.mesh.gateway, seed_base=7_000_000, max_tokens=4)
        calls = await driver.open_loop(30, 15, random.Random(0))
        for _ in range(100):
            if all(tap.terminals.get(q.request_id) for q in dups) and \
                    r.xlen(dead_stream(rig.prefix)) - dead_before >= 4:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        dead = r.xlen(dead_stream(rig.prefix)) - dead_before
    finally:
        stop.set()
        await task
        await asyncio.to_thread(rig.stop)
    assert all(len(tap.terminals.get(q.request_id, [])) == 1 for q in dups)
    assert all(tap.started.get(q.request_id) == 1 for q in dups)
    assert dead == sum(len(v) for v in payloads.values()) == 4
    res = summarize(RowResult("smoke", "smoke"), calls, tap)
    assert res.accepted == 30 and res.lost == 0 and res.duplicated == 0 and res.extra["ok"] == 30
    told = [rid for rid, ts in tap.terminals.items() if rid.startswith("poison-")]
    assert len(told) == len(payloads["wrong_schema"]) == 1
    assert tap.terminals[told[0]][0][1] == "internal_error"
