"""The simulator service against a real redis-server: twin from the GMG, forecasts and rates in Redis, what-if
RPC round trips, online correction from step reports, and a clean timeout when nobody answers."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client import generate_latest

from shared.config import Settings
from shared.gmg import GMGStore, Reservation
from shared.messages import (SegmentStat, StepReport, WhatIfCandidate, events_stream, requests_stream,
                             sim_corrections_key, sim_forecast_key, sim_rates_key)
from shared.streams import StreamProducer
from services.simulator.client import WhatIfClient, WhatIfTimeout
from services.simulator.service import SimulatorService
from bench.synthetic_state import write_synthetic_state

from support.sim_pair import CLUSTER, TENANTS
from support.wait import until

pytestmark = pytest.mark.integration



async def test_service_forecasts_answers_and_corrects(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    reqs = await write_synthetic_state(store, CLUSTER, TENANTS, random.Random(3), running=(2, 4), mean_input=64,
                                       max_tokens=32, stage_guests=1)
    await StreamProducer(redis).add_many([(requests_stream(prefix), r) for r in reqs])
    svc = SimulatorService(Settings(redis_url=redis_url, prefix=prefix), CLUSTER, TENANTS,
                           refresh_interval_s=0.05, publish_interval_s=0.1)
    task = asyncio.create_task(svc.run(serve_http=False))
    client = WhatIfClient(redis, redis_url, prefix)
    try:
        assert await until(lambda: redis.exists(sim_forecast_key(prefix, "c0")))
        fc = {k.decode(): v.decode() for k, v in (await redis.hgetall(sim_forecast_key(prefix, "c0"))).items()}
        assert fc["label"] == "simulated" and fc["tenant"] == "a" and int(fc["limit"]) > 0
        rates = {k.decode(): v.decode() for k, v in (await redis.hgetall(sim_rates_key(prefix))).items()}
        assert float(rates["a"]) > 0 and float(rates["a:mean_input"]) > 0

        cands = [WhatIfCandidate(kind="admit", tenant="a", device="c0", input_tokens=32, output_tokens=8),
                 WhatIfCandidate(kind="lease", tenant="a", device="c2", home_device="c0", segments=["mlp[0]"],
                                 duration_s=0.5, share=0.5, memory_bytes=1 << 20)]
        reply = await client.whatif(cands, timeout_s=5.0)
        assert reply.epoch == svc.follower.epoch and [o.index for o in reply.outcomes] == [0, 1]
        assert reply.outcomes[0].feasible and reply.outcomes[1].memory_ok

        # the GMG changes: c0 fills up; the twin follows and the same admission no longer fits
        await store.reserve([Reservation("c0", "kv:big", "kv", "a", int((await store.device("c0"))["limit"])
                                         - int((await store.device("c0"))["reserved"]))])
        epoch = await store.epoch()

        async def refused():
            r = await client.whatif(cands[:1], timeout_s=5.0)
            return r if r.epoch >= epoch else None
        r2 = await until(refused)
        assert r2
        assert not r2.outcomes[0].memory_ok and "memory:c0" in r2.outcomes[0].reasons

        # measured segment times 3x the model: the correction factor and error metric appear
        cost = svc.core.twin.cost("a", "c0")
        for i in range(30):
            await StreamProducer(redis).add(events_stream(prefix), StepReport(
                msg_id=f"s{i}", device="c0", tenant="a", window_start_ts=i, window_end_ts=i + 0.5, steps=4,
                busy_ms=1.0, segments=[SegmentStat("mlp[1]", 8, 4, 4 * 3.0 * cost.mlp_time(8) * 1e3)]))
        corr = await until(lambda: redis.hget(sim_corrections_key(prefix), "c0/mlp"))
        assert corr
        assert await until(lambda: _eq(svc.core.corrections.snapshot().get("c0/mlp", {}).get("samples"), 30))
        assert svc.core.corrections.factor("c0", "mlp") == pytest.approx(3.0, rel=0.05)
        metrics = generate_latest(svc.shell.registry).decode()
        assert 'slicesched_sim_prediction_error{device="c0",op="mlp"}' in metrics
    finally:
        await client.close()
        svc.shell.stop.set()
        await asyncio.wait_for(task, 30)


async def _eq(v, want):
    return v == want


async def test_whatif_times_out_cleanly_without_a_simulator(redis_url, redis, prefix):
    client = await WhatIfClient(redis, redis_url, prefix).start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(WhatIfTimeout):
            await client.whatif([WhatIfCandidate(kind="admit", tenant="a", device="c0")], timeout_s=0.2)
        assert time.perf_counter() - t0 < 1.0
    finally:
        await client.close()
