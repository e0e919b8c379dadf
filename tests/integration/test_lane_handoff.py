"""Lane hand-off between two real CPU workers (services/worker/handoff.py): the GMG service and both workers run in
this process against a real redis-server; the test stands in for the scheduler (a ``sequences`` lease of ``tiny-a``
on ``cpu1`` with ``handback``, requests assigned to that lane) and for the gateway (reads the token chunks).
A handed-over request must decode at home (``cpu0``) with exactly the tokens of running alone, its chunks numbered
without a gap; a hand-off the home refuses leaves the request on the guest, again with the same tokens."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from services.gmg.service import GMGService
from services.worker.lanes import GuestLanes
from services.worker.service import WorkerService, kv_blocks_for_device, lane_kv_blocks
from shared.codec import decode
from services.worker.emulated import EmulatedEngine
from shared.config import REPO_CONFIGS, Settings, home_tenant_of, load_cluster, load_tenants
from shared.gmg import GMGStore, Reservation
from shared.messages import (GROUP_WORKER, AssignRequest, EventsMsg, InferenceRequest, LeaseGranted, RequestFinished, RequestMoved,
                             TokenChunk, TokensMsg, events_stream, tokens_stream, worker_stream)
from shared.model.engine import Engine, SamplingParams
from shared.model.loader import build_model
from shared.requests_state import req_key
from shared.streams import StreamProducer, entry_payload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _engine(tenant, device, cluster):
    model, tok = build_model(tenant.model, "cpu")
    bpb = tenant.model.config.kv_bytes_per_token() * 16
    return Engine(model, tok, kv_blocks=min(256, kv_blocks_for_device(device, cluster.headroom_fraction,
                                                                       model.weight_bytes, bpb)), block_size=16)


def _worker(settings, cluster, tenants, did):
    device = cluster.device(did)
    tenant = home_tenant_of(cluster, tenants, did)
    if device.backend == "emulated":
        cfg = tenant.model.config
        engine = EmulatedEngine(cfg, device.kind, kv_blocks=kv_blocks_for_device(
            device, cluster.headroom_fraction, cfg.weight_bytes(), cfg.kv_bytes_per_token() * 16))

        def lane_engine(t, kv_blocks):
            return EmulatedEngine(t.model.config, device.kind, kv_blocks=kv_blocks)
    else:
        engine = _engine(tenant, device, cluster)

        def lane_engine(t, kv_blocks):
            m, tok = build_model(t.model, "cpu")
            return Engine(m, tok, kv_blocks=kv_blocks, block_size=16)

    lanes = GuestLanes({t.name: t for t in tenants.tenants if t.name != tenant.name}, lane_engine,
                       lambda t: min(128, lane_kv_blocks(device, cluster.headroom_fraction, engine.weight_bytes, t)))
    return WorkerService(settings, cluster, device, tenant, engine, tenants=tenants, lanes=lanes)


def _reference(tenant, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model, tok = build_model(tenant.model, "cpu")
    eng = Engine(model, tok, kv_blocks=64, block_size=16)
    for i, p in enumerate(prompts):
        eng.add(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=7 + i))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for ev in eng.step().events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@contextlib.asynccontextmanager
async def _mesh(redis_url, prefix, redis, cluster_file: str, tenants_file: str, devices: tuple[str, ...]):
    """The GMG service and the workers of ``devices`` in this process."""
    cluster = load_cluster(REPO_CONFIGS / cluster_file)
    tenants = load_tenants(REPO_CONFIGS / tenants_file, cluster)
    settings = Settings(redis_url=redis_url, prefix=prefix)
    gmg = GMGService(settings, cluster, tenants)
    workers = {d: _worker(settings, cluster, tenants, d) for d in devices}
    tasks = [asyncio.create_task(gmg.run(serve_http=False))]
    try:
        deadline = time.monotonic() + 60
        while not gmg.shell.ready:  # the cluster is registered before the workers account their weights
            assert time.monotonic() < deadline and not tasks[0].done(), "the GMG never became ready"
            await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(w.run()) for w in workers.values()]
        while not all(w.shell.ready for w in workers.values()):
            assert time.monotonic() < deadline, "services never became ready"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.05)
        store = GMGStore(redis, prefix)
        while True:
            rows = await store.devices()
            if all(rows.get(d, {}).get("state") == "ready" for d in workers):
                break
            assert time.monotonic() < deadline, "devices never reported ready"
            await asyncio.sleep(0.1)
        yield cluster, tenants, workers, store
    finally:
        for w in workers.values():
            w.shell.stop.set()
        gmg.shell.stop.set()
        await asyncio.wait(tasks, timeout=15)


@pytest.fixture
async def mesh(redis_url, prefix, redis):
    async with _mesh(redis_url, prefix, redis, "cluster-tiny.yaml", "tenants-tiny.yaml", ("cpu0", "cpu1")) as m:
        yield m


async def _lease_on_cpu1(redis, prefix, workers, handback: bool, tenant: str = "tiny-a", home: str = "cpu0",
                         guest: str = "cpu1") -> None:
    now = time.time()
    await StreamProducer(redis).add(worker_stream(prefix, guest), LeaseGranted(
        msg_id=uuid.uuid4().hex, lease_id=uuid.uuid4().hex[:12], tenant=tenant, home_device=home,
        guest_device=guest, segments=["*"], start_ts=now, end_ts=now + 120, share=0.5, mode="sequences",
        handback=handback))
    deadline = time.monotonic() + 30
    while workers[guest].lanes.engine_for(tenant) is None:
        assert time.monotonic() < deadline, "the lane was never staged"
        await asyncio.sleep(0.05)


async def _assign(redis, prefix, store, gw: str, prompts, max_tokens: int, tenant: str = "tiny-a",
                  guest: str = "cpu1") -> list[str]:
    """As the scheduler: reserve each request's KV on the guest and put it on the guest's stream."""
    rids, items = [], []
    for i, p in enumerate(prompts):
        rid = f"{gw}-{i}"
        req = InferenceRequest(msg_id=uuid.uuid4().hex, request_id=rid, tenant=tenant, gateway=gw, prompt_ids=p,
                               max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=7 + i,
                               arrival_ts=time.time())
        assert isinstance(await store.reserve([Reservation(guest, f"kv:{rid}", "kv", tenant, 1 << 16)]), int)
        await redis.hset(req_key(prefix, rid), mapping={"state": "assigned", "tenant": tenant, "gateway": gw,
                                                         "device": guest})
        items.append((worker_stream(prefix, guest), AssignRequest(msg_id=uuid.uuid4().hex, request=req,
                                                                  device=guest, kv_blocks=4)))
        rids.append(rid)
    await StreamProducer(redis).add_many(items)
    return rids


async def _collect(redis, prefix, gw: str, rids: list[str], timeout_s: float = 60) -> dict[str, list[TokenChunk]]:
    out: dict[str, list[TokenChunk]] = {r: [] for r in rids}
    stream, last = tokens_stream(prefix, gw), "0"
    deadline = time.monotonic() + timeout_s
    while not all(c and c[-1].finish_reason for c in out.values()):
        assert time.monotonic() < deadline, {r: len(c) for r, c in out.items()}
        for _, entries in await redis.xread({stream: last}, count=500, block=200) or []:
            for eid, fields in entries:
                last = eid
                msg = decode(entry_payload(fields), TokensMsg)
                assert isinstance(msg, TokenChunk), msg
                out[msg.request_id].append(msg)
    return out


async def _events(redis, prefix) -> list:
    return [decode(entry_payload(f), EventsMsg) for _, f in await redis.xrange(events_stream(prefix))]


PROMPTS = [[5, 9, 14, 22, 31, 40, 2, 7, 19, 3], [11, 4, 8, 15, 16, 23, 42]]
MAX_TOKENS = 12


def _check_tokens(chunks: dict[str, list[TokenChunk]], rids, ref) -> None:
    for rid, want in zip(rids, ref):
        cs = chunks[rid]
        assert [c.seq for c in cs] == list(range(len(cs))), [c.seq for c in cs]  # numbered without a gap
        assert [t for c in cs for t in c.token_ids] == want
        assert cs[-1].finish_reason == "length"


def _check_moved(chunks: dict[str, list[TokenChunk]], rids, guest: str, home: str) -> None:
    """Emulated tokens: every one came, numbered without a gap, the first from ``guest`` and the last from ``home``."""
    for rid in rids:
        cs = chunks[rid]
        assert [c.seq for c in cs] == list(range(len(cs)))
        assert sum(len(c.token_ids) for c in cs) == MAX_TOKENS and cs[-1].finish_reason == "length"
        assert cs[0].device == guest and cs[-1].device == home


async def test_a_handed_over_request_decodes_at_home_with_the_same_tokens(mesh, redis, prefix):
    cluster, tenants, workers, store = mesh
    ref = _reference(tenants.get("tiny-a"), PROMPTS, MAX_TOKENS)
    await _lease_on_cpu1(redis, prefix, workers, handback=True)
    gw = f"gw{uuid.uuid4().hex[:6]}"
    rids = await _assign(redis, prefix, store, gw, PROMPTS, MAX_TOKENS)
    chunks = await _collect(redis, prefix, gw, rids)
    _check_tokens(chunks, rids, ref)
    for rid in rids:  # the first token came from the guest lane, the rest from the home
        assert chunks[rid][0].device == "cpu1" and chunks[rid][-1].device == "cpu0"
    assert workers["cpu1"].handoffs.stats["sent"] == 2 and workers["cpu0"].handoffs.stats["received"] == 2
    deadline = time.monotonic() + 10
    while True:
        evs = await _events(redis, prefix)
        fin = {e.request_id: e for e in evs if isinstance(e, RequestFinished)}
        if all(r in fin for r in rids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    moved = {e.request_id: e for e in evs if isinstance(e, RequestMoved)}
    for rid in rids:
        assert (moved[rid].from_device, moved[rid].device) == ("cpu1", "cpu0")
        assert moved[rid].worker_id == workers["cpu0"].worker_id
        assert fin[rid].device == "cpu0" and fin[rid].completion_tokens == MAX_TOKENS
        h = await redis.hgetall(req_key(prefix, rid))
        assert h[b"worker_id"].decode() == workers["cpu0"].worker_id and b"handoff" not in h
    # the home took its own reservation for each; nothing is left running or paused on the guest
    held = await store.reservations("cpu0")
    assert all(f"kv:{r}" in held for r in rids)
    lane = workers["cpu1"].lanes.lanes["tiny-a"].engine
    assert not lane.running_ids() and lane.kv_blocks_free == lane.kv_blocks_total
    assert not workers["cpu1"].tracker.items
    # both entries acked: the guest's AssignRequests at the hand-off, the home's HandOffs when the requests ended
    for d in ("cpu0", "cpu1"):
        pend = await redis.xpending(worker_stream(prefix, d), GROUP_WORKER)
        assert pend["pending"] == 0, (d, pend)


async def test_a_refused_hand_off_leaves_the_request_on_the_guest(mesh, redis, prefix):
    cluster, tenants, workers, store = mesh
    ref = _reference(tenants.get("tiny-a"), PROMPTS[:1], MAX_TOKENS)
    row = (await store.devices())["cpu0"]
    free = int(row["limit"]) - int(row["reserved"])
    assert isinstance(await store.reserve([Reservation("cpu0", "test:fill", "kv", "tiny-a", free)]), int)
    await _lease_on_cpu1(redis, prefix, workers, handback=True)
    gw = f"gw{uuid.uuid4().hex[:6]}"
    rids = await _assign(redis, prefix, store, gw, PROMPTS[:1], MAX_TOKENS)
    chunks = await _collect(redis, prefix, gw, rids)
    _check_tokens(chunks, rids, ref)
    assert {c.device for c in chunks[rids[0]]} == {"cpu1"}
    assert workers["cpu1"].handoffs.stats["refused"] == 1 and workers["cpu1"].handoffs.stats["sent"] == 0
    assert f"kv:{rids[0]}" not in await store.reservations("cpu0")
    h = await redis.hgetall(req_key(prefix, rids[0]))
    assert b"handoff" not in h


async def test_emulated_devices_hand_over_at_the_links_time(redis_url, prefix, redis):
    """Emulated workers (no tensors): the same protocol; the home waits the modelled link time of the KV."""
    async with _mesh(redis_url, prefix, redis, "cluster-emulated8.yaml", "tenants-emulated6.yaml",
                     ("e0", "e2")) as (cluster, tenants, workers, store):
        await _lease_on_cpu1(redis, prefix, workers, True, tenant="em-a", home="e0", guest="e2")
        gw = f"gw{uuid.uuid4().hex[:6]}"
        rids = await _assign(redis, prefix, store, gw, PROMPTS, MAX_TOKENS, tenant="em-a", guest="e2")
        _check_moved(await _collect(redis, prefix, gw, rids), rids, "e2", "e0")  # to the lease's home
        assert workers["e2"].handoffs.stats["sent"] == 2 and workers["e0"].handoffs.stats["received"] == 2


async def test_a_full_home_hands_over_to_another_device_of_the_container(redis_url, prefix, redis):
    """The lease's home (e0) has no memory left for the KV: the sequence goes to the other device of em-a's
    container (e1), as the simulator's ``LeaseBook._other_home`` does, and decodes there."""
    async with _mesh(redis_url, prefix, redis, "cluster-emulated8.yaml", "tenants-emulated6.yaml",
                     ("e0", "e1", "e2")) as (cluster, tenants, workers, store):
        row = (await store.devices())["e0"]
        free = int(row["limit"]) - int(row["reserved"])
        assert isinstance(await store.reserve([Reservation("e0", "test:fill", "kv", "em-a", free)]), int)
        await _lease_on_cpu1(redis, prefix, workers, True, tenant="em-a", home="e0", guest="e2")
        gw = f"gw{uuid.uuid4().hex[:6]}"
        rids = await _assign(redis, prefix, store, gw, PROMPTS, MAX_TOKENS, tenant="em-a", guest="e2")
        _check_moved(await _collect(redis, prefix, gw, rids), rids, "e2", "e1")
        assert workers["e2"].handoffs.stats["sent"] == 2 and workers["e2"].handoffs.stats["refused"] == 0
        assert workers["e1"].handoffs.stats["received"] == 2 and workers["e0"].handoffs.stats["received"] == 0


async def test_a_home_full_of_cached_guest_weights_evicts_them_to_take_the_sequence(redis_url, prefix, redis):
    """The lease's home (e0, the container's only running device) has no memory left but weights another tenant's
    lease staged there and no lease pins: the hand-off's reservation evicts them (in the GMG, as the scheduler's
    placements and the simulator's hand-back do) instead of leaving the sequence on the lane; KV reservations
    (above, the refused hand-off) are never evicted."""
    async with _mesh(redis_url, prefix, redis, "cluster-emulated8.yaml", "tenants-emulated6.yaml",
                     ("e0", "e2")) as (cluster, tenants, workers, store):
        row = (await store.devices())["e0"]
        free = int(row["limit"]) - int(row["reserved"])
        assert isinstance(await store.reserve([Reservation("e0", "weights:em-c:*", "weights", "em-c", free)]), int)
        await redis.hset(store.keys.resident("e0"), "em-c|*", free)
        await _lease_on_cpu1(redis, prefix, workers, True, tenant="em-a", home="e0", guest="e2")
        gw = f"gw{uuid.uuid4().hex[:6]}"
        rids = await _assign(redis, prefix, store, gw, PROMPTS, MAX_TOKENS, tenant="em-a", guest="e2")
        _check_moved(await _collect(redis, prefix, gw, rids), rids, "e2", "e0")
        assert workers["e2"].handoffs.stats["refused"] == 0 and workers["e0"].handoffs.stats["received"] == 2
        assert "weights:em-c:*" not in await store.reservations("e0")
        assert not await redis.hexists(store.keys.resident("e0"), "em-c|*")


async def test_the_scheduler_follows_a_moved_request(redis_url, prefix, redis):
    """RequestMoved: the scheduler's record points at the home (cancels, a dead worker's requests go there) and the
    guest's KV reservation is released; a late or repeated notice changes nothing more."""
    from services.scheduler.policy import load_live_policy
    from services.scheduler.service import SchedulerService
    from shared.requests_state import assigned_key

    cluster = load_cluster(REPO_CONFIGS / "cluster-tiny.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-tiny.yaml", cluster)
    store = GMGStore(redis, prefix)
    await store.register_cluster(cluster, tenants)
    sched = SchedulerService(Settings(redis_url=redis_url, prefix=prefix), cluster, tenants,
                             load_live_policy("container"))
    try:
        req = InferenceRequest(msg_id="m", request_id="r1", tenant="tiny-a", gateway="gw", prompt_ids=[1, 2, 3],
                               max_tokens=4)
        assert isinstance(await store.reserve([Reservation("cpu1", "kv:r1", "kv", "tiny-a", 4096)]), int)
        await redis.sadd(assigned_key(prefix, "cpu1"), "r1")
        sched.assigned["r1"] = ("cpu1", req, "w-guest")
        moved = RequestMoved(msg_id="x", request_id="r1", tenant="tiny-a", from_device="cpu1", device="cpu0",
                             worker_id="w-home", kv_blocks=1, ts=time.time())
        for _ in range(2):
            await sched._moved(moved)
            assert sched.assigned["r1"] == ("cpu0", req, "w-home")
            assert sched.assigned.per_device.get("cpu1", 0) == 0 and sched.assigned.per_device["cpu0"] == 1
            assert await redis.smembers(assigned_key(prefix, "cpu0")) == {b"r1"}
            assert not await redis.smembers(assigned_key(prefix, "cpu1"))
            assert "kv:r1" not in await store.reservations("cpu1")
        del sched.assigned["r1"]  # finished before the notice was read: nothing is re-created
        await sched._moved(moved)
        assert "r1" not in sched.assigned
    finally:
        await sched.redis.aclose()


async def test_the_home_takes_other_messages_while_it_fetches_a_handed_over_sequence(mesh, redis, prefix):
    """The KV fetch of a hand-off runs beside the home's stream handling: a request of the home's own tenant
    assigned meanwhile gets its first token before the fetch ends, and a cancel of the handed-over request that
    arrives during the fetch is applied once the hand-off commits (not dropped because the request is not
    tracked yet)."""
    from shared.messages import CancelAssigned

    cluster, tenants, workers, store = mesh
    home = workers["cpu0"]
    started, release = asyncio.Event(), asyncio.Event()
    fetch = home.lease_agent.fetch_kv

    async def gated(*args, **kw):
        started.set()
        await asyncio.wait_for(release.wait(), 4.0)  # under the guest's HANDOFF_TIMEOUT_S
        return await fetch(*args, **kw)

    home.lease_agent.fetch_kv = gated
    await _lease_on_cpu1(redis, prefix, workers, handback=True)
    gw = f"gw{uuid.uuid4().hex[:6]}"
    (moving,) = await _assign(redis, prefix, store, gw, PROMPTS[:1], 64)
    await asyncio.wait_for(started.wait(), 30)
    # as the scheduler: one request of the home's own tenant on the home, and a cancel of the one being received
    (own,) = await _assign(redis, prefix, store, gw + "own", PROMPTS[1:], 4, guest="cpu0")
    await StreamProducer(redis).add(worker_stream(prefix, "cpu0"), CancelAssigned(
        msg_id=uuid.uuid4().hex, request_id=moving, tenant="tiny-a"))
    own_chunks = await _collect(redis, prefix, gw + "own", [own], timeout_s=3.5)
    assert home.handoffs.stats["received"] == 0 and home.handoffs.receiving(moving)  # the fetch is still held
    assert own_chunks[own][-1].finish_reason == "length"
    release.set()
    deadline = time.monotonic() + 20
    while True:
        fin = {e.request_id: e for e in await _events(redis, prefix) if isinstance(e, RequestFinished)}
        if moving in fin:
            break
        assert time.monotonic() < deadline, "the cancelled request never ended"
        await asyncio.sleep(0.1)
    assert home.handoffs.stats["received"] == 1
    assert fin[moving].device == "cpu0" and fin[moving].outcome == "cancelled"
    assert fin[moving].completion_tokens < 64
    assert not home.handoffs.receiving(moving) and moving not in home.tracker.items
