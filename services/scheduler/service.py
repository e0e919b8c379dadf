"""Scheduler service shell: consumes the requests and events streams, places requests through the GMG's atomic
memory commits, forwards them to workers, cancels, and fails requests of dead workers."""
from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from redis.exceptions import ResponseError
from prometheus_client import Counter, Gauge, Histogram

from shared.config import ClusterConfig, Settings, TenantsConfig
from shared.gmg import GMGStore, Refused, Reservation
from shared.messages import (GROUP_SCHEDULER, AssignRequest, CancelAssigned, CancelRequest, EventsMsg,
                             InferenceRequest, RequestError, RequestFinished, RequestMoved, RequestsMsg,
                             WorkerHeartbeat,
                             dead_stream, events_stream, requests_stream, tokens_stream, worker_stream)
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client
from shared.requests_state import (TERMINAL_STATES, TERMINAL_TTL_S, TerminalFence, assigned_key, req_key,
                                   tenant_stats_key)
from shared.service import ServiceShell, run_tasks
from shared.streams import ACK, DEFER, Delivery, StreamConsumer, StreamProducer
from services.scheduler.core import AssignedTable, DeviceView, Pending, SchedulerCore
from services.scheduler.policy_bridge import LeaseManager, SnapshotBuilder
from services.scheduler.steering import SteeringFollower
from shared.gmg.keys import GMGKeys
from shared.gmg.lease_store import unpinned_entries
from shared.policies import Trigger
from shared.sim.steering import STALE_AFTER_S, CorrectedWhatIf

log = structlog.get_logger()

HEARTBEAT_STALE_S = 3.0
TOKENS_MAXLEN = 200_000


class SchedulerService:
    def __init__(self, settings: Settings, cluster: ClusterConfig, tenants: TenantsConfig, policy,
                 name: str = "scheduler-0", *, sim_steering: bool = True,
                 steering_stale_s: float = STALE_AFTER_S) -> None:
        self.s, self.cluster, self.tenants = settings, cluster, tenants
        self.p = settings.prefix
        self.name = name
        self.core = SchedulerCore(cluster, tenants, policy)
        self.redis = command_client(settings.redis_url, name=f"{name}-cmd")
        self.gmg = GMGStore(self.redis, self.p)
        self.producer = StreamProducer(self.redis)
        self.fence = TerminalFence(self.redis, self.p, name)
        self.shell = ServiceShell("scheduler", name, prefix=self.p, redis=self.redis)
        self.devices: dict[str, DeviceView] = {}
        self._hb_seen: dict[str, float] = {}  # device -> newest WorkerHeartbeat.ts read from the events stream
        self._placing: str | None = None  # request being placed (its awaits let a cancel arrive mid-way)
        self._late_cancels: dict[str, CancelRequest] = {}
        self.assigned = AssignedTable(tenants.home_of())  # request_id -> (device, req, worker_id)
        self.wake = asyncio.Event()
        self._blocking: list = []
        reg = self.shell.registry
        self.m_decision = Histogram("slicesched_scheduler_decision_seconds", "Time to place one request",
                                    registry=reg, buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .5))
        self.m_queue = Gauge("slicesched_queue_depth", "Requests queued in the scheduler", ["tenant"], registry=reg)
        self.m_admitted = Counter("slicesched_scheduler_admitted_total", "Requests placed", ["tenant", "device"],
                                  registry=reg)
        self.m_failed = Counter("slicesched_scheduler_failed_total", "Requests failed by the scheduler",
                                ["tenant", "code"], registry=reg)
        self.m_leases = Counter("slicesched_leases_total", "Lease events", ["event"], registry=reg)
        self.m_lag = Gauge("slicesched_stream_lag", "Entries not yet delivered to a consumer group",
                           ["stream", "group"], registry=reg)
        self.m_pending = Gauge("slicesched_stream_pending", "Entries delivered but not acked (PEL size)",
                               ["stream", "group"], registry=reg)
        self._streams_ts = 0.0
        self.snapshots = SnapshotBuilder(cluster, tenants, self.core)
        self.lease_mgr = LeaseManager(self.p, self.gmg, self.producer, tenants)
        self.rows: dict[str, dict[str, str]] = {}
        self.whatif = None
        if getattr(policy, "tick_s", None) or getattr(policy, "wants_arrival", False):
            self.whatif = CorrectedWhatIf.for_cluster(cluster)  # corrected by the simulator's steering copy
        self.steering = SteeringFollower(self.redis, self.p, self.whatif, enabled=sim_steering,
                                         stale_after_s=steering_stale_s, registry=reg)
        self._arrivals: set[str] = set()

    # ------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.shell.install_signal_handlers()
        await self.shell.serve_http(self.s.metrics_host,
                                    self.s.metrics_port)
        log.info("metrics_listening", port=self.shell.port)
        await self._wait_redis()
        await self._restore()
        req_consumer = self._consumer(requests_stream(self.p), RequestsMsg, self._on_request)
        ev_consumer = self._consumer(events_stream(self.p), EventsMsg, self._on_event)
        self.shell.ready = True
        log.info("scheduler_ready", policy=getattr(self.core.policy, "registry_name", "?"),
                 sim_steering="on" if self.steering.enabled else "off")
        tasks = [req_consumer.run(self.shell.stop), req_consumer.reclaim_loop(self.shell.stop),
                 ev_consumer.run(self.shell.stop), self._placement_loop(), self._device_loop(), self._policy_loop(),
                 self.shell.heartbeat_loop()]
        if self.whatif is not None:  # only policies that decide with the what-if use the simulator's copy
            tasks.append(self.steering.run(self.shell.stop))
        try:
            await run_tasks(self.shell, *tasks)
        finally:
            await self.shell.close_http()
            await close_quietly(self.redis, *self._blocking)

    def _consumer(self, stream: str, types, handler) -> StreamConsumer:
        b = blocking_client(self.s.redis_url, block_ms=1000, name=f"{self.name}-blk")
        self._blocking.append(b)
        return StreamConsumer(cmd=self.redis, blocking=b, stream=stream, group=GROUP_SCHEDULER, consumer=self.name,
                              types=types, handler=handler, dead_stream=dead_stream(self.p), on_dead=self._on_dead,
                              min_idle_ms=60_000)

    async def _wait_redis(self) -> None:
        while not self.shell.stop.is_set():
            try:
                await self.redis.ping()
                return
            except REDIS_ERRORS:
                await asyncio.sleep(0.2)

    async def _restore(self) -> None:
        """After a restart: rebuild the assigned map from Redis (queued requests come back from our PEL). Requests
        placed on a device or for a tenant the config no longer has end with a clear error to their gateway."""
        configured = [d.id for d in self.cluster.devices]
        head = assigned_key(self.p, "")
        removed = sorted({k.decode()[len(head):] async for k in self.redis.scan_iter(match=_glob(head) + "*", count=1000)}
                         - set(configured))
        ended = 0
        for did in configured + removed:
            for rid in await self.redis.smembers(assigned_key(self.p, did)):
                rid = rid.decode()
                h = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(req_key(self.p, rid))).items()}
                if not h or h.get("state") in TERMINAL_STATES:
                    await self.redis.srem(assigned_key(self.p, did), rid)
                    continue
                req = InferenceRequest(msg_id="restored", request_id=rid, tenant=h.get("tenant", ""),
                                       gateway=h.get("gateway", ""), prompt_ids=[], max_tokens=0)
                if did in removed:
                    await self._end_unconfigured(req, did, 503, "device_removed", f"device {did!r} is no longer in "
                                                 "the cluster config; retry the request", retryable=True)
                elif req.tenant not in self.core.queues.bounds:
                    await self._end_unconfigured(req, did, 404, "tenant_removed",
                                                 f"tenant {req.tenant!r} is no longer configured", retryable=False)
                else:
                    self.assigned[rid] = (did, req, h.get("worker_id", ""))
                    continue
                ended += 1
            if did in removed:
                await self.redis.delete(assigned_key(self.p, did))
        if self.assigned or ended:
            log.info("scheduler_restored", assigned=len(self.assigned), ended_unconfigured=ended,
                     removed_devices=",".join(removed))

    async def _end_unconfigured(self, req: InferenceRequest, device: str, status: int, code: str, message: str, *,
                                retryable: bool) -> None:
        """End an assigned request of a tenant or device the config no longer has (at start-up)."""
        log.warning("request_failed_unconfigured", tenant=req.tenant, request_id=req.request_id, device=device,
                    code=code)
        if any(d.id == device for d in self.cluster.devices):  # a removed device's stream expires unread
            await self.producer.add(worker_stream(self.p, device), CancelAssigned(
                msg_id=uuid.uuid4().hex, request_id=req.request_id, tenant=req.tenant, reason=code))
        await self._fail(req, status, code, message, retryable=retryable)
        await self.gmg.release(device, f"kv:{req.request_id}")
        await self.redis.srem(assigned_key(self.p, device), req.request_id)

    # ------------------------------------------------------------ requests stream
    async def _on_request(self, d: Delivery) -> str:
        msg = d.msg
        if isinstance(msg, CancelRequest):
            await self._cancel(msg)
            return ACK
        req: InferenceRequest = msg
        if req.tenant not in self.core.queues.bounds:
            await self._fail(req, 400, "unknown_tenant", f"tenant {req.tenant!r} is not configured", state="rejected")
            return ACK
        queued = self.core.queues.find(req.request_id)
        if req.request_id in self.assigned or queued is not None:
            # our own queued entry re-delivered (reclaim) stays pending; a second copy of it is acked at once
            return DEFER if queued is not None and queued.entry_id == d.entry_id else ACK
        created = await self.redis.hsetnx(req_key(self.p, req.request_id), "state", "queued")
        if not created:
            state = await self.redis.hget(req_key(self.p, req.request_id), "state")
            if state and state.decode() != "queued":
                return ACK  # already handled before a restart (or a duplicate XADD)
        await self.redis.hset(req_key(self.p, req.request_id), mapping={
            "tenant": req.tenant, "gateway": req.gateway, "queued_ts": time.time(),
            "prompt_tokens": len(req.prompt_ids), "max_tokens": req.max_tokens})
        p = self.core.pending_for(req, d.entry_id, time.time())
        self.snapshots.rates[req.tenant].observe(time.time(), len(req.prompt_ids), req.max_tokens)
        if not self.core.queues.push(p):
            await self._fail(req, 429, "tenant_queue_full", f"tenant {req.tenant} has too many queued requests",
                             state="rejected", retryable=True)
            return ACK
        self.wake.set()
        return DEFER  # acked once placed (or failed): a crash here loses nothing

    async def _cancel(self, msg: CancelRequest) -> None:
        if msg.request_id == self._placing:  # mid-placement: applied once the placement has committed or given up
            self._late_cancels[msg.request_id] = msg
            return
        p = self.core.queues.pop(msg.tenant, msg.request_id) if msg.tenant in self.core.queues.bounds else None
        if p is not None:
            await self._set_state(msg.request_id, "cancelled")
            await self.redis.xack(requests_stream(self.p), GROUP_SCHEDULER, p.entry_id)
            return
        a = self.assigned.get(msg.request_id)
        if a is not None:
            await self.producer.add(worker_stream(self.p, a[0]), CancelAssigned(
                msg_id=uuid.uuid4().hex, request_id=msg.request_id, tenant=msg.tenant, reason=msg.reason))

    # ------------------------------------------------------------ placement
    async def _placement_loop(self) -> None:
        while not self.shell.stop.is_set():
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            try:
                await self._place_all()
            except REDIS_ERRORS as e:
                log.warning("placement_redis_error", error=repr(e))
                await asyncio.sleep(0.2)

    async def _place_all(self) -> None:
        now = time.time()
        for tenant in list(self.core.queues.queues):
            while True:
                p = self.core.queues.head(tenant)
                if p is None:
                    break
                if p.req.deadline_ts and now > p.req.deadline_ts:
                    self.core.queues.pop(tenant, p.req.request_id)
                    await self._fail(p.req, 504, "deadline_exceeded", "request deadline passed while queued")
                    await self.redis.xack(requests_stream(self.p), GROUP_SCHEDULER, p.entry_id)
                    continue
                if not await self._place(p):
                    break  # head of line waits for memory; FIFO per tenant
            self.m_queue.labels(tenant).set(self.core.queues.depth(tenant))

    def snapshot(self, routing: Pending | None = None):
        """The policy's snapshot; ``routing``: the queued request about to be routed, left out of its homes'
        queues (``SnapshotBuilder.build``)."""
        return self.snapshots.build(time.time(), self.devices, self.rows, self.assigned, self.lease_mgr.active,
                                    (routing.req.tenant, routing.req.request_id) if routing is not None else None)

    def decision_snapshot(self):
        """The snapshot a policy's ``decide`` runs on: :meth:`snapshot` with the simulator's forecast applied when
        its steering copy is in use (routing a request keeps to what the scheduler observes now)."""
        return self.steering.steer(self.snapshot())

    async def _place(self, p: Pending) -> bool:
        self._placing = p.req.request_id
        try:
            placed = await self._place_on_device(p)
        finally:
            self._placing = None
        late = self._late_cancels.pop(p.req.request_id, None)
        if late is not None:  # the request is now either still queued or assigned: cancel it there
            await self._cancel(late)
        return placed

    async def _place_on_device(self, p: Pending) -> bool:
        t0 = time.perf_counter()
        snap = self.snapshot(routing=p)
        dev = self.core.policy.route(p.req.tenant, len(p.req.prompt_ids), p.req.max_tokens, snap)
        for dev in ([dev] if dev is not None and dev in self.devices and self.devices[dev].up else []):
            view = self.devices[dev]
            kv = [Reservation(dev, f"kv:{p.req.request_id}", "kv", p.req.tenant, p.kv_bytes)]
            # cached guest weights make way in the same commit, as the simulator's admission does
            res = await self.gmg.commit_making_room("reserve", kv, [self.lease_mgr.room(dev)])
            if not isinstance(res, Refused):
                self.lease_mgr.note_evicted(res.evicted)
            if isinstance(res, Refused):
                if res.reason == "duplicate":  # reserved before a restart: reuse it
                    pass
                else:
                    view.reserved = view.limit - int(res.detail or 0) if res.detail.lstrip("-").isdigit() else view.reserved
                    continue
            view.reserved += p.kv_bytes
            view.assigned += 1
            rid = p.req.request_id
            # not one MULTI: the two keys live in different slots on a Redis Cluster; the set is only a hint for
            # a restarted scheduler, which checks each request's hash (_restore)
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(req_key(self.p, rid), mapping={"state": "assigned", "device": dev, "kv_blocks": p.kv_blocks,
                                                     "worker_id": view.worker_id, "assigned_ts": time.time()})
            pipe.sadd(assigned_key(self.p, dev), rid)
            await pipe.execute()
            await self.producer.add(worker_stream(self.p, dev), AssignRequest(  # durable: the entry is acked next
                msg_id=uuid.uuid4().hex, request=p.req, device=dev, kv_blocks=p.kv_blocks), durable=True)
            self.assigned[rid] = (dev, p.req, view.worker_id)
            if self.snapshots.home_of.get(dev) == p.req.tenant:
                if len(view.placed_since) < 4096:
                    view.placed_since.append((time.time(), len(p.req.prompt_ids), p.req.arrival_ts))
                    view.touch()
            elif len(view.lane_placed_since) < 4096:
                view.lane_placed_since.append((time.time(), p.req.tenant, len(p.req.prompt_ids)))
                view.touch()
            self.core.queues.pop(p.req.tenant, rid)
            await self.redis.xack(requests_stream(self.p), GROUP_SCHEDULER, p.entry_id)
            self.m_decision.observe(time.perf_counter() - t0)
            self.m_admitted.labels(p.req.tenant, dev).inc()
            self._arrivals.add(dev)
            log.debug("request_placed", tenant=p.req.tenant, request_id=rid, device=dev)
            return True
        return False

    # ------------------------------------------------------------ leases (policies with decide())
    async def _policy_loop(self) -> None:
        """Ticks and arrival triggers of the policy's ``decide``; leases committed through the GMG."""
        if self.whatif is None:
            await self.shell.stop.wait()  # returning early would end run_tasks and stop the service
            return
        tick = getattr(self.core.policy, "tick_s", None) or 0.2
        last_tick = 0.0
        while not self.shell.stop.is_set():
            try:
                await asyncio.wait_for(self.shell.stop.wait(), timeout=min(0.05, tick))
            except asyncio.TimeoutError:
                pass
            try:
                now = time.time()
                for st in await self.lease_mgr.expire(now):
                    self.m_leases.labels("expired").inc()
                triggers = [Trigger("arrival", device=d, tenant=self.snapshots.home_of.get(d))
                            for d in sorted(self._arrivals)] if self.core.policy.wants_arrival else []
                self._arrivals.clear()
                if now - last_tick >= tick:
                    triggers.append(Trigger("tick"))
                    last_tick = now
                for trig in triggers:
                    t0 = time.perf_counter()
                    actions = self.core.policy.decide(trig, self.decision_snapshot(), self.whatif)
                    if actions:
                        before = (self.lease_mgr.granted, self.lease_mgr.revoked)
                        await self.lease_mgr.apply(actions, time.time())
                        self.m_leases.labels("granted").inc(self.lease_mgr.granted - before[0])
                        self.m_leases.labels("revoked").inc(self.lease_mgr.revoked - before[1])
                        self.m_decision.observe(time.perf_counter() - t0)
            except REDIS_ERRORS as e:
                log.warning("policy_redis_error", error=repr(e))
            except Exception:
                log.exception("policy_decision_failed")

    # ------------------------------------------------------------ events stream
    async def _on_event(self, d: Delivery) -> str:
        msg = d.msg
        if isinstance(msg, RequestFinished):
            a = self.assigned.get(msg.request_id)
            if a is not None:  # once per request: a redelivered finish finds it gone
                self.snapshots.request_ended(msg, a[1].arrival_ts)
            await self._finished(msg.request_id, msg.device, "done" if msg.outcome in ("stop", "length")
                                 else msg.outcome if msg.outcome in ("cancelled", "failed") else "done")
        elif isinstance(msg, RequestMoved):
            await self._moved(msg)
        elif isinstance(msg, WorkerHeartbeat):
            self._hb_seen[msg.device] = max(self._hb_seen.get(msg.device, 0.0), msg.ts)
            v = self.devices.get(msg.device)
            if v is not None:
                v.heartbeat_ts, v.running = msg.ts, msg.running
                v.on_heartbeat(msg.ts, msg.queued, msg.queued_prefill_tokens, msg.prefill_oldest_ts)
                v.guest_lanes, v.guest_share = list(msg.guest_lanes), msg.guest_share
                if msg.worker_id and v.worker_id != msg.worker_id:
                    v.worker_id = msg.worker_id
                v.up = True
        return ACK

    async def _finished(self, rid: str, device: str, state: str) -> None:
        a = self.assigned.pop(rid, None)
        await self.gmg.release(device, f"kv:{rid}")
        await self.fence.claim(rid, state)  # no-op when the request already ended (e.g. failed, then a late finish)
        await self.redis.srem(assigned_key(self.p, device), rid)
        v = self.devices.get(device)
        if v is not None and a is not None:
            v.assigned = max(0, v.assigned - 1)
        self.wake.set()

    async def _moved(self, m: RequestMoved) -> None:
        """A guest lane handed a running request to a home worker: its record (cancels, KV release, a dead
        worker's requests) follows it; the guest's KV reservation is released (the home reserved its own)."""
        await self.gmg.release(m.from_device, f"kv:{m.request_id}")
        await self.redis.srem(assigned_key(self.p, m.from_device), m.request_id)
        a = self.assigned.get(m.request_id)
        if a is None or a[0] != m.from_device:
            return  # ended (or moved) meanwhile: the home's own finish releases its reservation
        self.assigned[m.request_id] = (m.device, a[1], m.worker_id)
        await self.redis.sadd(assigned_key(self.p, m.device), m.request_id)
        for dev, k in ((m.from_device, -1), (m.device, 1)):
            v = self.devices.get(dev)
            if v is not None:
                v.assigned = max(0, v.assigned + k)
        self.wake.set()

    # ------------------------------------------------------------ device health
    async def _device_loop(self) -> None:
        rounds = 0
        while not self.shell.stop.is_set():
            rounds += 1
            try:
                await self._refresh_devices()
                await self._fail_dead_devices()
                if rounds % 10 == 0:
                    await self._fail_lost_assignments()
                await self._publish_tenant_stats()
                await self._export_stream_stats()
            except REDIS_ERRORS as e:
                log.warning("device_refresh_error", error=repr(e))
            try:
                await asyncio.wait_for(self.shell.stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def _refresh_devices(self) -> None:
        rows = await self.gmg.devices()
        keys = GMGKeys(self.p)
        pipe = self.redis.pipeline(transaction=False)
        for did in rows:
            pipe.hgetall(keys.resident(did))
            pipe.hgetall(keys.pins(did))
        replies = await pipe.execute()
        for i, did in enumerate(list(rows)):
            res, pins = replies[2 * i], replies[2 * i + 1]
            rows[did]["resident"] = ",".join(r.decode() if isinstance(r, bytes) else r for r in res)
            home = self.snapshots.home_of.get(did)
            # weights staged here that no active lease pins: a cache the lease manager evicts when it needs room
            rows[did]["evictable"] = sum(n for _, _, n in unpinned_entries(res, pins, (home,) if home else ()))
            old = self.rows.get(did)
            if old == rows[did]:
                rows[did] = old  # unchanged: the same object tells the snapshot builder it has nothing to redo
        self.rows = rows
        now = time.time()
        per_device = self.assigned.per_device
        for did, h in rows.items():
            # heartbeats seen directly on the events stream count too: a GMG restart must not fail healthy work
            hb = max(float(h.get("heartbeat_ts") or 0), self._hb_seen.get(did, 0.0))
            up = h.get("state") == "ready" and now - hb < HEARTBEAT_STALE_S
            v = self.devices.get(did)
            assigned = per_device.get(did, 0)
            if v is None:
                v = self.devices[did] = DeviceView(did, up, int(h.get("limit") or 0), int(h.get("reserved") or 0))
            v.up, v.limit, v.reserved = up, int(h.get("limit") or 0), int(h.get("reserved") or 0)
            v.heartbeat_ts, v.assigned = hb, assigned
            wid = h.get("worker_id", "")
            # the GMG's row may lag a heartbeat read directly (a new worker after a restart): keep the newer id
            if wid and float(h.get("heartbeat_ts") or 0) >= self._hb_seen.get(did, 0.0):
                v.worker_id = wid

    async def _fail_dead_devices(self) -> None:
        """Requests on a device whose worker died (or restarted) end with a clear, retryable error."""
        for rid, (dev, req, wid) in list(self.assigned.items()):
            v = self.devices.get(dev)
            if v is None:
                continue
            restarted = bool(wid) and bool(v.worker_id) and v.worker_id != wid
            if v.up and not restarted:
                continue
            log.warning("request_failed_worker_down", tenant=req.tenant, request_id=rid, device=dev,
                        restarted=restarted)
            await self.producer.add(worker_stream(self.p, dev), CancelAssigned(
                msg_id=uuid.uuid4().hex, request_id=rid, tenant=req.tenant, reason="worker_failed"))
            gw = req.gateway or (await self.redis.hget(req_key(self.p, rid), "gateway") or b"").decode()
            if await self.fence.claim(rid, "failed") and gw:  # fenced if the worker finished it first
                await self.producer.add(tokens_stream(self.p, gw), RequestError(
                    msg_id=uuid.uuid4().hex, request_id=rid, tenant=req.tenant, status=503, code="worker_failed",
                    message=f"the worker on device {dev} failed; retry the request", retryable=True),
                    maxlen=TOKENS_MAXLEN, durable=True)
            self.m_failed.labels(req.tenant, "worker_failed").inc()
            await self._finished(rid, dev, "failed")

    async def _fail_lost_assignments(self) -> None:
        """Assigned requests whose journey hash vanished (Redis lost its data: AOF off, a flush) never reached a
        worker (a worker that runs one writes it back): end them with a clear, retryable error."""
        rids = list(self.assigned)
        if not rids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.exists(req_key(self.p, rid))
        for rid, exists in zip(rids, await pipe.execute()):
            a = self.assigned.get(rid)
            if exists or a is None:
                continue
            dev, req, _ = a
            log.warning("request_failed_state_lost", tenant=req.tenant, request_id=rid, device=dev)
            if await self.fence.claim(rid, "failed") and req.gateway:
                await self.producer.add(tokens_stream(self.p, req.gateway), RequestError(
                    msg_id=uuid.uuid4().hex, request_id=rid, tenant=req.tenant, status=503, code="state_lost",
                    message="the request's state was lost with Redis; retry the request", retryable=True),
                    maxlen=TOKENS_MAXLEN, durable=True)
            self.m_failed.labels(req.tenant, "state_lost").inc()
            await self._finished(rid, dev, "failed")

    async def _export_stream_stats(self) -> None:
        """Lag and pending counts of every consumer group on the mesh's streams (every 5 s)."""
        if time.monotonic() - self._streams_ts < 5.0:
            return
        self._streams_ts = time.monotonic()
        streams = [requests_stream(self.p), events_stream(self.p)] + [worker_stream(self.p, d.id)
                                                                       for d in self.cluster.devices]
        for st in streams:
            try:
                groups = await self.redis.xinfo_groups(st)
            except ResponseError:
                continue
            name = st[len(self.p):]
            for g in groups:
                gname = g.get("name", b"")
                gname = gname.decode() if isinstance(gname, bytes) else str(gname)
                lag = g.get("lag")
                self.m_lag.labels(name, gname).set(float(lag) if lag is not None else float("nan"))
                self.m_pending.labels(name, gname).set(float(g.get("pending") or 0))

    async def _publish_tenant_stats(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        per_tenant = self.assigned.per_tenant
        for t in self.tenants.tenants:
            running = per_tenant.get(t.name, 0)
            up = sum(1 for d in t.home_devices if d in self.devices and self.devices[d].up)
            pipe.hset(tenant_stats_key(self.p, t.name), mapping={
                "queued": self.core.queues.depth(t.name), "running": running, "ts": time.time(),
                "homes_up": up, "homes": len(t.home_devices)})
        await pipe.execute()

    # ------------------------------------------------------------ helpers
    async def _set_state(self, rid: str, state: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(req_key(self.p, rid), mapping={"state": state, f"{state}_ts": time.time()})
        if state in TERMINAL_STATES:
            pipe.expire(req_key(self.p, rid), TERMINAL_TTL_S)
        await pipe.execute()

    async def _fail(self, req: InferenceRequest, status: int, code: str, message: str, *, state: str = "failed",
                    retryable: bool = False) -> None:
        self.m_failed.labels(req.tenant, code).inc()
        if await self.fence.claim(req.request_id, state) and req.gateway:
            await self.producer.add(tokens_stream(self.p, req.gateway), RequestError(
                msg_id=uuid.uuid4().hex, request_id=req.request_id, tenant=req.tenant, status=status, code=code,
                message=message, retryable=retryable), maxlen=TOKENS_MAXLEN, durable=True)

    async def _on_dead(self, stream: str, entry_id: str, raw: bytes | None, reason: str) -> None:
        """A poison entry on our streams: if it decodes far enough to name a request, tell its gateway."""
        log.warning("scheduler_dead_letter", stream=stream, entry_id=entry_id, reason=reason[:200])
        loose = loose_decode(raw)
        rid, gw, tenant = loose.get("request_id"), loose.get("gateway"), loose.get("tenant", "")
        if isinstance(rid, str) and isinstance(gw, str) and isinstance(tenant, str) and stream.endswith("requests"):
            if not await self.fence.claim(rid, "failed"):
                return
            await self.producer.add(tokens_stream(self.p, gw), RequestError(
                msg_id=uuid.uuid4().hex, request_id=rid, tenant=tenant, status=500, code="internal_error",
                message="the request could not be processed", retryable=False), maxlen=TOKENS_MAXLEN,
                durable=True)


def _glob(text: str) -> str:
    """``text`` with the characters special in a Redis MATCH pattern escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def loose_decode(raw: bytes | None) -> dict:
    """Best-effort, bounded decode of a poison entry to find who to answer; never raises."""
    if not raw or len(raw) > 1_000_000:
        return {}
    try:
        import msgspec

        v = msgspec.msgpack.decode(raw)
    except Exception:
        return {}
    return v if isinstance(v, dict) else {}
