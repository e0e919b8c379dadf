"""Matrix row 18: the engine raises during generation. The real GMG, scheduler and worker services run in this
process against a real redis-server; the worker's engine is the real tiny model whose ``step`` raises whenever a
"poison" request is in its batch (an injected fault: nothing in the mesh can make the real engine fail on demand).
Expected: the error reaches the requester (500 ``engine_error``), the slot and KV are released, and the request is
not retried."""
from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
import redis as syncredis

from reliability.results import RowResult, record
from reliability.scenario import SEEDS, fake_request, n_requests, xadd_requests
from reliability.tap import Tap
from services.gmg.service import GMGService
from services.scheduler.policy import load_live_policy
from services.scheduler.service import SchedulerService
from services.worker.service import WorkerService, kv_blocks_for_device
from shared.config import REPO_CONFIGS, Settings, load_cluster, load_tenants
from shared.messages import GROUP_WORKER, worker_stream
from shared.model.engine import Engine
from shared.model.loader import build_model

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]


class FaultyEngine(Engine):
    """The real engine; a step whose batch holds a ``poison-`` request raises (as an OOM or a kernel error would)."""

    faults = 0

    def step(self):
        if any(rid.startswith("poison-") for rid in self._running):
            self.faults += 1
            raise RuntimeError("injected engine fault")
        return super().step()


@pytest.mark.parametrize("seed", SEEDS)
async def test_row18_engine_exception(redis_url, prefix, seed):
    res = RowResult("18", "engine exception during generation", seed=seed)
    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)
    settings = Settings(redis_url=redis_url, prefix=prefix)
    device, tenant = cluster.device("cpu0"), tenants.get("tiny-a")
    model, tok = build_model(tenant.model, "cpu")
    bpb = tenant.model.config.kv_bytes_per_token() * 16
    engine = FaultyEngine(model, tok, kv_blocks=kv_blocks_for_device(device, cluster.headroom_fraction,
                                                                     model.weight_bytes, bpb), block_size=16)
    gmg = GMGService(settings, cluster, tenants)
    sched = SchedulerService(settings, cluster, tenants, load_live_policy("container"))
    worker = WorkerService(settings, cluster, device, tenant, engine)
    tasks = [asyncio.create_task(gmg.run(serve_http=False)), asyncio.create_task(sched.run()),
             asyncio.create_task(worker.run())]
    tap = Tap(redis_url, prefix)
    stop = asyncio.Event()
    tap_task = asyncio.create_task(tap.run(stop))
    gw = f"relgw-18-{uuid.uuid4().hex[:6]}"
    rng = random.Random(seed)
    t0 = time.monotonic()
    try:
        r = syncredis.Redis.from_url(redis_url)
        while not (sched.shell.ready and worker.shell.ready and gmg.shell.ready):
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # first heartbeats reach the GMG: the device is up for the scheduler
        reqs = []
        for i in range(n_requests(200)):
            q = fake_request("tiny-a", gw, max_tokens=rng.randint(2, 12))
            if i % 20 == 10:
                q = type(q)(**{**{f: getattr(q, f) for f in q.__struct_fields__},
                               "request_id": "poison-" + q.request_id, "msg_id": "poison-" + q.msg_id})
            reqs.append(q)
        for i in range(0, len(reqs), 20):
            await asyncio.to_thread(xadd_requests, r, prefix, reqs[i:i + 20])
            await asyncio.sleep(0.25)
        rids = [q.request_id for q in reqs]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(tap.terminals.get(x) for x in rids):
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # late events, then the state every slot must be back to
        poison = [x for x in rids if x.startswith("poison-")]
        first = {x: tap.terminals[x][0] for x in rids if tap.terminals.get(x)}
        codes: dict[str, int] = {}
        for x, (kind, code, *_) in first.items():
            codes["ok" if kind == "finish" else code] = codes.get("ok" if kind == "finish" else code, 0) + 1
        rsv = r.hkeys(f"{prefix}{{gmg}}:reservations:cpu0")
        res.requests = res.accepted = len(rids)
        res.lost = len(rids) - len(first)
        res.duplicated = sum(1 for x in rids if len(tap.terminals.get(x, [])) > 1)
        res.errors = {k: v for k, v in codes.items() if k != "ok"}
        res.extra.update({
            "poison": len(poison), "engine_faults": engine.faults,
            "poison_told_engine_error": sum(1 for x in poison if first.get(x, ("", ""))[1] == "engine_error"),
            "collateral_failures": sum(1 for x in rids if not x.startswith("poison-")
                                       and first.get(x, ("", ""))[1] == "engine_error"),
            "retries_per_job_max": max(tap.started.get(x, 0) for x in rids),
            "engine_running_after": len(engine.running_ids()) + len(engine.waiting_ids()),
            "kv_blocks_free_after": f"{engine.kv_blocks_free}/{engine.kv_blocks_total}",
            "kv_reservations_after": sum(1 for k in rsv if k.startswith(b"kv:")),
            "worker_pending_after": r.xpending(worker_stream(prefix, "cpu0"), GROUP_WORKER)["pending"]})
        res.duration_s = round(time.monotonic() - t0, 1)
        res.note("a failing step fails every request in that batch (collateral), each with a clear 500 "
                 "engine_error; nothing is retried; services ran in one process (integration level)")
        record(res)
    finally:
        stop.set()
        await tap_task
        for svc in (worker, sched, gmg):
            svc.shell.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert res.lost == 0 and res.duplicated == 0
    assert res.extra["poison_told_engine_error"] == len(poison) and res.extra["retries_per_job_max"] == 1
    assert res.extra["engine_running_after"] == 0 and res.extra["kv_reservations_after"] == 0
    assert engine.kv_blocks_free == engine.kv_blocks_total and res.extra["worker_pending_after"] == 0
