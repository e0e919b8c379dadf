"""The simulator steers the live scheduler, against a real redis-server: a correction the simulator service learns
from measured segment times reaches the scheduler's what-if through the versioned ``sim:steering`` copy and changes
its predicted segment and iteration times; with the simulator gone (stale copy), no copy, or steering turned off,
the scheduler prices with the uncorrected cost model and says so in its metrics."""
from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import generate_latest

from shared.config import Settings
from shared.gmg import GMGStore
from shared.messages import SegmentStat, StepReport, events_stream, requests_stream, sim_steering_key
from shared.policies import GrantLease
from shared.streams import StreamProducer
from services.scheduler.policy import load_live_policy
from services.scheduler.service import SchedulerService
from services.simulator.service import SimulatorService
from bench.synthetic_state import write_synthetic_state

from support.sim_pair import CLUSTER, TENANTS

pytestmark = pytest.mark.integration



def _gauge(svc: SchedulerService, name: str) -> float:
    for line in generate_latest(svc.shell.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _predictions(sched: SchedulerService) -> tuple[float, float]:
    """(the what-if's mlp segment time of tenant a on a cpu device for 8 tokens, its predicted home iteration)."""
    snap = sched.decision_snapshot()
    ten = snap.tenants["a"]
    seg = sched.whatif.cost(ten, "cpu").mlp_time(8)
    cand = GrantLease("a", "c0", "c2", ("mlp[0]",), 0.5, 0.5, 1 << 20)
    return seg, sched.whatif.evaluate(snap, [cand])[0].home_iter_s


async def _scheduler(redis_url: str, prefix: str, **kw) -> SchedulerService:
    sched = SchedulerService(Settings(redis_url=redis_url, prefix=prefix), CLUSTER, TENANTS,
                             load_live_policy("slice"), **kw)
    await sched._refresh_devices()
    return sched


async def test_a_learned_correction_changes_the_schedulers_predicted_segment_time(redis_url, redis, prefix):
    store = GMGStore(redis, prefix)
    reqs = await write_synthetic_state(store, CLUSTER, TENANTS, random.Random(3), running=(2, 4), mean_input=64,
                                       max_tokens=32, stage_guests=1)
    await StreamProducer(redis).add_many([(requests_stream(prefix), r) for r in reqs])
    sim = SimulatorService(Settings(redis_url=redis_url, prefix=prefix), CLUSTER, TENANTS)
    sched = await _scheduler(redis_url, prefix)
    try:
        await sim.start()  # twin and first forecasts; the loops are driven by hand below
        seg0, it0 = _predictions(sched)
        assert await sched.steering.poll() == "absent" and sched.steering.copy is None
        assert _predictions(sched) == (seg0, it0)
        assert _gauge(sched, "slicesched_scheduler_sim_steering_version") == 0

        # before it has learned anything the copy carries no factors: the scheduler's prices do not move
        v1 = await sim.publish_steering()
        assert await sched.steering.poll() == "in_use" and sched.steering.copy.version == v1
        assert sched.steering.copy.factors == {} and _predictions(sched) == (seg0, it0)
        assert set(sched.steering.copy.busy) == {"c0", "c1", "c2"}  # the forecast of every device comes along

        # the workers measure mlp segments at 3x the cost model; the simulator learns it from the events stream
        cost = sim.core.twin.cost("a", "c0")
        for i in range(30):
            await StreamProducer(redis).add(events_stream(prefix), StepReport(
                msg_id=f"s{i}", device="c0", tenant="a", window_start_ts=i, window_end_ts=i + 0.5, steps=4,
                busy_ms=1.0, segments=[SegmentStat("mlp[1]", 8, 4, 4 * 3.0 * cost.mlp_time(8) * 1e3)]))
        await asyncio.wait_for(sim.events.run(sim.shell.stop, max_messages=30), 30)  # group from id 0: all 30
        assert sim.core.corrections.factor("c0", "mlp") == pytest.approx(3.0, rel=0.01)
        assert sched.steering.copy.version == v1 and _predictions(sched) == (seg0, it0)  # not yet published

        v2 = await sim.publish_steering()
        assert v2 == v1 + 1
        stored = {k.decode(): v.decode() for k, v in (await redis.hgetall(sim_steering_key(prefix))).items()}
        assert stored["label"] == "simulated" and float(stored["factor:cpu/mlp"]) == pytest.approx(3.0, abs=0.01)
        assert await sched.steering.poll() == "in_use" and sched.steering.copy.version == v2
        seg1, it1 = _predictions(sched)
        assert seg1 == pytest.approx(3.0 * seg0, rel=0.01)  # the correction reached the scheduler's what-if
        assert it1 > it0  # and its predicted iteration of the leasing home with it
        assert _gauge(sched, "slicesched_scheduler_sim_steering_version") == v2
        assert _gauge(sched, "slicesched_scheduler_sim_steering_factors") >= 1

        # the simulator stops publishing: once the copy is stale the scheduler falls back to the plain model
        real = sched.steering.clock
        sched.steering.clock = lambda: real() + sched.steering.stale_after_s + 1
        assert await sched.steering.poll() == "stale" and sched.steering.copy is None
        assert _predictions(sched) == (seg0, it0)
        assert _gauge(sched, "slicesched_scheduler_sim_steering_version") == 0
        assert _gauge(sched, "slicesched_scheduler_sim_steering_age_seconds") > sched.steering.stale_after_s
        v3 = await sim.publish_steering()  # ... and takes it up again when a new version comes
        assert await sched.steering.poll() == "in_use" and sched.steering.copy.version == v3
        assert _predictions(sched)[0] == pytest.approx(seg1)

        # steering turned off (SLICESCHED_SIM_STEERING=0): the copy is there and not used
        off = await _scheduler(redis_url, prefix, sim_steering=False)
        try:
            assert await off.steering.poll() == "off" and off.steering.copy is None
            assert _predictions(off) == pytest.approx((seg0, it0))
        finally:
            await off.redis.aclose()

        # a malformed copy is refused, not applied half
        await redis.hset(sim_steering_key(prefix), mapping={"version": str(v3 + 1), "factor:cpu/mlp": "-1"})
        assert await sched.steering.poll() == "bad" and _predictions(sched) == (seg0, it0)
    finally:
        sim.shell.stop.set()
        await sched.redis.aclose()
        await asyncio.gather(sim.redis.aclose(), *(b.aclose() for b in sim._blocking), return_exceptions=True)
