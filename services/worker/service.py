"""Worker service shell: consumes its device stream, runs the batching engine on a compute thread, streams
tokens to gateways, reports heartbeats / step statistics / finished requests on the events stream."""
from __future__ import annotations

import asyncio
import functools
import math
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import structlog
from prometheus_client import Counter, Gauge

from shared.config import ClusterConfig, DeviceConfig, Settings, TenantConfig, TenantsConfig, env_number
from shared.config_error import ConfigError
from shared.costmodel import cost_for
from shared.costmodel.sla import request_targets
from shared.gmg import GMGStore, Refused, Reservation
from shared.messages import (GROUP_WORKER, AssignRequest, CancelAssigned, HandOff, HandOffReply, LeaseGranted,
                             LeaseRevoked, RequestError, RequestFinished, RequestStarted, WorkerHeartbeat, WorkerMsg,
                             dead_stream, events_stream, tokens_stream, worker_stream)
from shared.model.engine import Engine
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client
from shared.requests_state import TERMINAL_STATES, TerminalFence, req_key
from shared.service import ServiceShell, instance_id, run_tasks
from shared.streams import ACK, DEFER, Delivery, StreamConsumer, StreamProducer
from services.worker.core import StepAggregator, Tracker
from services.worker.direct_publish import DirectPublisher
from services.worker.handoff import HandOffs, sampling_params

log = structlog.get_logger()

TOKENS_MAXLEN = 200_000
EVENTS_MAXLEN = 200_000
HEARTBEAT_S = 0.5
HEARTBEAT_MIN_S = 0.02  # shortest gap before a heartbeat a lane's change asked for
BURST_MAX_S = 0.05  # longest run of home steps without a pass through the event loop
PUBLISH_BACKLOG = 8  # steps whose tokens wait to be published before a burst of steps ends
PUBLISH_LIMIT = 64  # ... and before the compute loop waits for the publisher


class WorkerService:
    def __init__(self, settings: Settings, cluster: ClusterConfig, device: DeviceConfig, tenant: TenantConfig,
                 engine: Engine, *, tenants: TenantsConfig | None = None, lease_options=None, lanes=None) -> None:
        self.s, self.cluster, self.device, self.tenant, self.engine = settings, cluster, device, tenant, engine
        self.lanes = lanes  # GuestLanes for "sequences" leases (services/worker/lanes.py), or None
        if lanes is not None:
            lanes.tpot_s = tenant.sla.tpot_ms / 1e3  # what the home's steps may yield is bounded by its TPOT target
        self.engine_of: dict[str, Engine] = {}  # request id -> the engine running it (home or a guest lane)
        self.tenants_by_name = {t.name: t for t in tenants.tenants} if tenants is not None else {tenant.name: tenant}
        self._beat_now = asyncio.Event()  # heartbeat now: a lane changed (_report_lanes) or a backlog halved
        self._lanes_reported: frozenset[str] = frozenset()  # lanes accepting new sequences at the last heartbeat
        # prompt tokens not yet prefilled, as the last heartbeat said: the home's (None) and each lane's (its tenant)
        self._prefill_reported: dict[str | None, int] = {}
        self._no_deadline: set[str] = set()  # tenants whose model has no cost profile for this device's kind
        self.configured = set(self.tenants_by_name)
        self.p = settings.prefix
        self.worker_id = instance_id(f"worker-{device.id}")
        self.redis = command_client(settings.redis_url, name=f"worker-{device.id}")
        self.blocking = blocking_client(settings.redis_url, block_ms=1000, name=f"worker-{device.id}-blk")
        self.gmg = GMGStore(self.redis, self.p)
        self.producer = StreamProducer(self.redis)
        self.fence = TerminalFence(self.redis, self.p, self.worker_id, owner=self.worker_id)
        self.shell = ServiceShell("worker", device.id, prefix=self.p, redis=self.redis)
        self.tracker = Tracker(device.id)
        self.agg = StepAggregator(device.id, tenant.name)
        self.pending_ops: list[tuple[str, object]] = []  # ("add", AssignRequest) | ("cancel", CancelAssigned) |
        #   ("handoff", a received sequence joining the next step)
        self.wake = asyncio.Event()
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{device.id}")
        self.publish_q: asyncio.Queue = asyncio.Queue()  # bounded by _burst (PUBLISH_BACKLOG)
        # steps' events handed to the loop's publisher and not yet published; the compute thread publishes a step
        # itself (services/worker/direct_publish.py) only when this is zero, so chunks keep their order
        self._loop_pending = 0
        self._pending_lock = threading.Lock()
        self._agg_lock = threading.Lock()  # StepAggregator and busy time: written by both threads
        self.direct = None if os.environ.get("SLICESCHED_DIRECT_PUBLISH", "1") == "0" else \
            DirectPublisher(settings.redis_url, maxlen=TOKENS_MAXLEN, name=f"worker-{device.id}-pub")
        self.consumer = StreamConsumer(cmd=self.redis, blocking=self.blocking, stream=worker_stream(self.p, device.id),
                                       group=GROUP_WORKER, consumer=device.id, types=WorkerMsg, handler=self._on_msg,
                                       dead_stream=dead_stream(self.p), min_idle_ms=60_000)
        self.lease_agent = None  # guest execution (services/worker/lease_agent.py) when the backend supports it
        if tenants is not None:
            self.lease_agent = self._make_lease_agent(tenants, lease_options)
        self.handoffs = HandOffs(self)  # guest lanes handing prefilled sequences home (services/worker/handoff.py)
        if self.lease_agent is not None:
            self.lease_agent.kv_exports = self.handoffs.exports
        self._busy_s = 0.0
        self._busy_mark = time.monotonic()
        reg = self.shell.registry
        self.m_tokens = Counter("slicesched_worker_tokens_total", "Output tokens generated", ["device", "tenant"],
                                registry=reg)
        self.m_busy = Gauge("slicesched_device_busy_ratio", "Busy fraction since the last heartbeat", ["device"],
                            registry=reg)
        self.m_mem = Gauge("slicesched_device_memory_bytes", "Device memory", ["device", "kind"], registry=reg)
        self.m_fenced = Counter("slicesched_worker_fenced_results_total",
                                "Results not published because the request had already ended elsewhere",
                                ["device"], registry=reg)

    # ------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        self.shell.install_signal_handlers()
        await self.shell.serve_http(self.s.metrics_host,
                                    self.s.metrics_port)
        log.info("metrics_listening", port=self.shell.port)
        await self._reserve_weights()
        if self.lease_agent is not None:
            await self.lease_agent.start()
        self.shell.ready = True
        await self._heartbeat()
        log.info("worker_ready", tenant=self.tenant.name, kv_blocks=self.engine.kv_blocks_total,
                 weight_bytes=self.engine.weight_bytes, worker_id=self.worker_id)
        try:
            extra = [self.lease_agent.maintain_loop(self.shell.stop)] if self.lease_agent is not None else []
            # the reclaim loop also trims acked entries (MINID below pending): without it worker streams only grow
            await run_tasks(self.shell, self.consumer.run(self.shell.stop), self.consumer.reclaim_loop(self.shell.stop),
                            self._compute_loop(),
                            self._publish_loop(), self._heartbeat_loop(),
                            self.shell.heartbeat_loop(extra=self._health_extra), *extra)
            await self._drain()
        finally:
            await self.handoffs.close()
            self.compute.shutdown(wait=False, cancel_futures=True)
            if self.direct is not None:
                self.direct.close()
            if self.lease_agent is not None:
                await self.lease_agent.close()
            await self.shell.close_http()
            await close_quietly(self.redis, self.blocking)

    def _make_lease_agent(self, tenants: TenantsConfig, options):
        """Guest execution for this backend: real (cpu/cuda) or cost-model time only (emulated)."""
        if self.device.backend == "emulated":
            from services.worker.emulated_leases import EmulatedLeaseAgent
            return EmulatedLeaseAgent(cluster=self.cluster, device=self.device, tenant=self.tenant, tenants=tenants,
                                      engine=self.engine, peers=options,  # the process's EmulatedPeers, if any
                                      lanes=self.lanes)
        from services.worker.lease_agent import LeaseAgent
        return LeaseAgent(prefix=self.p, redis=self.redis, gmg=self.gmg, cluster=self.cluster, device=self.device,
                          tenant=self.tenant, tenants=tenants, engine=self.engine, options=options,
                          home_busy=lambda: self.engine.has_work() or bool(self.pending_ops))

    def _step(self):
        """One engine step on the compute thread (through the lease agent when there is one)."""
        return self.lease_agent.step() if self.lease_agent is not None else self.engine.step()

    def _lane_step(self, eng):
        """A guest-lane iteration holds the device like home work, so leased segments never run concurrently."""
        lock = getattr(self.lease_agent, "lock", None)
        if lock is None:
            res = eng.step()
        else:
            with lock.home():
                res = eng.step()
        if self.lanes is not None and self.lanes.hands_back(eng):
            self.handoffs.pause_first_tokens(eng, res.events)
        return res

    def _health_extra(self) -> dict:
        # ``tenant``: the GMG's start-up reconciliation refuses to remove the state of a tenant a live worker serves
        extra = {"tenant": self.tenant.name, **{f"handoffs_{k}": v for k, v in self.handoffs.stats.items()}}
        if self.lease_agent is not None:
            extra.update(self.lease_agent.health_fields())
        return extra

    async def _reserve_weights(self) -> None:
        while not self.shell.stop.is_set():
            try:
                owner = f"weights:{self.tenant.name}:home"
                res = await self.gmg.reserve([Reservation(self.device.id, owner, "weights", self.tenant.name,
                                                          self.engine.weight_bytes)])
                if isinstance(res, Refused) and res.reason == "duplicate":
                    # kept from an earlier run: a changed model (same tenant name) holds another size
                    held = (await self.gmg.reservations(self.device.id)).get(owner)
                    if held is not None and held.nbytes != self.engine.weight_bytes:
                        log.info("weights_reservation_resized", was=held.nbytes, now=self.engine.weight_bytes)
                        res = await self.gmg.resize(self.device.id, owner, self.engine.weight_bytes)
                if isinstance(res, Refused) and res.reason not in ("duplicate",):
                    log.error("weights_reservation_refused", reason=res.reason, detail=res.detail)
                return
            except REDIS_ERRORS as e:
                log.warning("redis_unavailable", error=repr(e))
                await asyncio.sleep(0.5)

    async def _drain(self) -> None:
        """On SIGTERM: stop taking work; in-flight requests end with a retryable error and release their KV."""
        for rid in list(self.tracker.items):
            await self._end(rid, "failed", error=(503, "worker_draining", "the worker is shutting down; retry"))

    # ------------------------------------------------------------ stream handling
    async def _on_msg(self, d: Delivery) -> str:
        msg = d.msg
        if isinstance(msg, AssignRequest):
            rid = msg.request.request_id
            if rid in self.tracker.items:
                # our entry re-delivered stays pending (acked when the request ends); a second assignment of a
                # running request (a retried XADD) is acked at once
                return DEFER if self.tracker.items[rid].entry_id == d.entry_id else ACK
            state = await self.redis.hget(req_key(self.p, rid), "state")
            if state is not None and state.decode() in TERMINAL_STATES:
                return ACK  # failed/cancelled while we were away: fenced
            if msg.request.tenant not in self.configured:  # assigned before a restart that removed the tenant
                self.tracker.add(msg.request, d.entry_id, msg.kv_blocks)
                await self._end(rid, "failed", error=(404, "tenant_removed",
                                                      f"tenant {msg.request.tenant!r} is no longer configured"))
                return DEFER
            if msg.request.tenant != self.tenant.name:
                lane = self.lanes.engine_for(msg.request.tenant) if self.lanes is not None else None
                if lane is None:  # placed here without an accepting guest lane: a clean, retryable refusal
                    self.tracker.add(msg.request, d.entry_id, msg.kv_blocks)
                    await self._end(rid, "failed", error=(503, "guest_lane_unavailable",
                                                          "the guest lane for this tenant closed; retry"))
                    return DEFER
                self.engine_of[rid] = lane
            self.tracker.add(msg.request, d.entry_id, msg.kv_blocks)
            self.pending_ops.append(("add", msg))
            self.wake.set()
            await self.redis.hset(req_key(self.p, rid), mapping={"state": "running", "running_ts": time.time(),
                                                                 "worker_id": self.worker_id})
            return DEFER  # acked when the request ends
        if isinstance(msg, HandOff):
            return await self.handoffs.receive(d.entry_id, msg)
        if isinstance(msg, HandOffReply):
            self.handoffs.on_reply(msg)
            return ACK
        if isinstance(msg, LeaseGranted) and msg.mode == "sequences":
            if msg.guest_device == self.device.id and self.lanes is not None:
                self.lanes.on_granted(msg)
                self._report_lanes()
                self.wake.set()
            return ACK
        if isinstance(msg, LeaseRevoked) and self.lanes is not None and msg.guest_device == self.device.id \
                and msg.tenant in self.lanes.lanes:
            self.lanes.on_revoked(msg)
            self._report_lanes()
        if isinstance(msg, (LeaseGranted, LeaseRevoked)):
            if self.lease_agent is not None:
                await self.lease_agent.on_message(msg)
            else:
                log.info("lease_ignored", lease_id=msg.lease_id, reason="no guest execution on this backend")
            return ACK
        if isinstance(msg, CancelAssigned):
            if msg.request_id in self.tracker.items:
                self.pending_ops.append(("cancel", msg))
                self.wake.set()
            elif self.handoffs.receiving(msg.request_id):
                self.handoffs.cancel_after(msg)
            return ACK
        return ACK

    # ------------------------------------------------------------ compute
    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.shell.stop.is_set():
            await self._apply_ops()
            await self._stage_lanes(loop)
            eng = self.lanes.next_engine(self.engine) if self.lanes is not None else \
                (self.engine if self.engine.has_work() else None)
            if eng is None:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            while self.publish_q.qsize() >= PUBLISH_LIMIT and not self.shell.stop.is_set():
                await asyncio.sleep(0.005)  # the publisher is behind (Redis slow or away): stop computing ahead
            try:
                if eng is self.engine:
                    await loop.run_in_executor(self.compute, self._burst, loop)
                else:
                    t0 = time.time()
                    res = await loop.run_in_executor(self.compute, functools.partial(self._lane_step, eng))
                    self._after_step(eng, t0, time.time(), res, self._to_loop(res.events))
                    if res.prefill_tokens and self._backlog_halved(eng):
                        self._beat_now.set()
            except Exception as e:  # a failed step fails its batch, not the worker
                log.exception("engine_step_failed")
                running = set(eng.running_ids())  # the failed batch; waiting requests were not in it
                for rid in list(self.tracker.items):
                    if rid in running:
                        eng.cancel(rid)
                        await self._end(rid, "failed", error=(500, "engine_error", f"generation failed: {e!r}"))
                continue

    def _burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Home steps back to back on the compute thread, each step's results handed to the event loop as it ends
        (no event-loop round trip between steps). Ends after one step when anything needs the loop between
        steps: a request to add or cancel, guest lanes to interleave, a publishing backlog, a stop, or
        ``BURST_MAX_S`` of stepping."""
        start = time.monotonic()
        while True:
            t0 = time.time()
            res = self._step()
            t1 = time.time()
            events = self._publish_direct(res.events)
            if events:
                loop.call_soon_threadsafe(self._after_step, self.engine, t0, t1, res, events)
            else:  # nothing for the loop: account here, without waking it
                self._account(self.engine, t0, t1, res)
            if res.prefill_tokens and self._backlog_halved(self.engine):
                loop.call_soon_threadsafe(self._beat_now.set)
            if (self.pending_ops or self.shell.stop.is_set() or not self.engine.has_work()
                    or (self.lanes is not None and self.lanes.lanes) or self.publish_q.qsize() >= PUBLISH_BACKLOG
                    or time.monotonic() - start > BURST_MAX_S):
                return

    def _backlog_halved(self, eng) -> bool:
        """After a step of ``eng`` (the home engine or a guest lane's) that prefilled: the prompt tokens it has left
        to prefill, with the requests assigned to it that it has not taken yet, are at most half what the last
        heartbeat reported for it. The next heartbeat then goes out now (``HEARTBEAT_MIN_S`` later), not up to
        ``HEARTBEAT_S`` later: the scheduler's routing and the hand-off's fill rule (``HandOffs._fill_target``) read
        these backlogs from heartbeats, and a home or lane that kept reporting its last queue for up to half a second
        looked twice as far behind as it was (a drained home as if each of its steps carried a prompt chunk). At most
        once per heartbeat per engine: a backlog drained chunk by chunk asks for a heartbeat each time it halves."""
        key = None if eng is self.engine else self._lane_tenant(eng)
        if key is None and eng is not self.engine:  # no lane of this device
            return False
        reported = self._prefill_reported.get(key, 0)
        if not reported:
            return False
        left = eng.prefill_backlog()[0] + sum(len(r.prompt_ids) for r in self._pending_adds().get(key, ()))
        if 2 * left > reported:
            return False
        self._prefill_reported[key] = 0  # once per heartbeat
        return True

    def _lane_tenant(self, eng) -> str | None:
        """The tenant whose guest lane ``eng`` is (None if it is none of this device's lanes)."""
        for t, lane in (self.lanes.lanes.items() if self.lanes is not None else ()):
            if lane.engine is eng:
                return t
        return None

    def _publish_direct(self, events: list) -> list:
        """On the compute thread: publish a step's chunks here when none finishes a request and the loop has
        nothing left to publish; returns the events the loop's publisher must still handle."""
        if self.direct is None or self._loop_pending or not self.direct.available():
            return self._to_loop(events)
        todo = []
        for ev in events:
            if ev.finish_reason is not None:
                return self._to_loop(events)
            t = self.tracker.items.get(ev.request_id)
            if t is not None and ev.token_ids:
                todo.append((t, ev))
        if not todo:
            return []
        chunks = [(tokens_stream(self.p, t.req.gateway),
                   self.tracker.chunk(t, ev.token_ids, ev.text, None, ev.prompt_tokens, ev.completion_tokens,
                                      [ev.logprobs] if ev.logprobs is not None else None))
                  for t, ev in todo]
        if not self.direct.publish(chunks):
            for t, _ in todo:  # the loop rebuilds these chunks with the same seq numbers
                t.seq -= 1
            return self._to_loop(events)
        for t, ev in todo:
            self.m_tokens.labels(self.device.id, t.req.tenant).inc(len(ev.token_ids))
        return []

    def _to_loop(self, events: list) -> list:
        if events:
            with self._pending_lock:
                self._loop_pending += 1
        return events

    def _after_step(self, eng, t0: float, t1: float, res, events: list) -> None:
        """On the event loop after each step: accounting and the hand-off of its remaining events to the
        publisher (``events``: what the compute thread did not publish itself)."""
        self._account(eng, t0, t1, res)
        if events:
            self.publish_q.put_nowait(events)

    def _account(self, eng, t0: float, t1: float, res) -> None:
        """Busy time and step statistics (either thread; the heartbeat reads and resets them under the lock)."""
        guest = None if eng is self.engine else (self._lane_tenant(eng) or "?")
        with self._agg_lock:
            self._busy_s += t1 - t0
            if guest is None:
                self.agg.add_step(t0, t1, res.prefill_tokens + res.decode_tokens, res.segment_ms)
            else:
                self.agg.add_guest_step(guest, t0, t1)
        if self.lanes is not None:
            self.lanes.record(guest is not None, t0, t1)  # deque appends: safe from either thread

    async def _stage_lanes(self, loop) -> None:
        """Stage guest-lane engines ("sequences" leases) between iterations, on the compute thread."""
        if self.lanes is None:
            return
        for t in list(self.lanes.lanes):
            if self.lanes.needs_staging(t):
                self.lanes.lanes[t].staging = True
                try:
                    await loop.run_in_executor(self.compute, self.lanes.stage, t)
                except Exception:
                    log.exception("lane_staging_failed", tenant=t)
                finally:
                    self.lanes.lanes[t].staging = False
                self._report_lanes()

    def _report_lanes(self) -> None:
        """Heartbeat now when a lane started or stopped taking new sequences since the last one: the scheduler
        routes to a lane only once a heartbeat says it is accepting (a lease is granted for ~1 s, and waiting
        for the next periodic heartbeat hid a third of it from routing on the emulated mesh)."""
        if self.lanes is not None and self.lanes.accepting() != self._lanes_reported:
            self._beat_now.set()

    async def _apply_ops(self) -> None:
        ops, self.pending_ops = self.pending_ops, []
        for kind, msg in ops:
            if kind == "add":
                r = msg.request
                eng = self.engine_of.get(r.request_id, self.engine)
                try:
                    eng.add(r.request_id, list(r.prompt_ids), sampling_params(r), self._first_token_due(eng, r))
                except ValueError as e:
                    await self._end(r.request_id, "failed", error=(400, "invalid_request", str(e)))
                    continue
                try:  # informational (GMG tracking): a Redis blip must not stop the compute loop
                    await self.producer.add(events_stream(self.p), RequestStarted(
                        msg_id=uuid.uuid4().hex, request_id=r.request_id, tenant=r.tenant, device=self.device.id,
                        ts=time.time()), maxlen=EVENTS_MAXLEN)
                except REDIS_ERRORS as e:
                    log.warning("request_started_not_published", request_id=r.request_id, error=repr(e))
            elif kind == "handoff":  # a received sequence joins the next step (services/worker/handoff.py)
                await self.handoffs.join(msg)
            else:
                eng = self.engine_of.get(msg.request_id, self.engine)
                if eng.cancel(msg.request_id) or msg.request_id in self.tracker.items:
                    await self._end(msg.request_id, "cancelled" if msg.reason != "worker_failed" else "failed")

    def _first_token_due(self, eng: Engine, r) -> float:
        """With ``SLICESCHED_DEADLINE_CHUNKS=1``: when ``r``'s first token is due (its arrival at the gateway plus
        its TTFT target), and ``eng`` set to admit and chunk prompts by that deadline with its iterations priced by
        the cost model of this device's kind (``shared/model/deadline.py``, as the simulator's
        ``deadline_chunks``); ``inf`` (arrival order) otherwise or where the kind has no profile. With
        ``SLICESCHED_STEP_CAP_S`` > 0 it also sets ``eng``'s step cap (``shared/model/step_cap.py``)."""
        spec = self.tenants_by_name.get(r.tenant)
        if spec is None or not (self.s.deadline_chunks or self.s.step_cap_s):
            return math.inf
        step = eng.deadline_step or (eng.step_cap[1] if eng.step_cap is not None else None)
        if step is None:
            try:
                cost = cost_for(spec.model.config, self.device.kind)
            except ConfigError as e:
                if r.tenant not in self._no_deadline:  # logged once per tenant
                    self._no_deadline.add(r.tenant)
                    log.warning("step_model_unavailable", tenant=r.tenant, kind=self.device.kind, error=str(e),
                                deadline_chunks=self.s.deadline_chunks, step_cap_s=self.s.step_cap_s)
                return math.inf
            scale = getattr(eng, "time_scale", 1.0)  # an emulated engine's iterations last scale × the model's

            def step(*a: int) -> float:
                return scale * cost.iteration_time(*a)
        if self.s.step_cap_s and eng.step_cap is None:
            eng.step_cap = (self.s.step_cap_s, step)
        if not self.s.deadline_chunks:
            return math.inf
        eng.deadline_step = step
        ttft = request_targets(spec.sla, spec.model.config, len(r.prompt_ids), r.max_tokens)[0]
        return (r.arrival_ts if r.arrival_ts > 0 else time.time()) + ttft

    async def _publish_loop(self) -> None:
        """Publishes each step's tokens (one pipelined round trip) while the next step computes."""
        while not (self.shell.stop.is_set() and self.publish_q.empty()):
            try:
                events = await asyncio.wait_for(self.publish_q.get(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            items, finished = [], []
            for ev in events:
                t = self.tracker.items.get(ev.request_id)
                if t is None or (not ev.token_ids and ev.finish_reason is None):
                    continue
                items.append((tokens_stream(self.p, t.req.gateway),
                              self.tracker.chunk(t, ev.token_ids, ev.text, ev.finish_reason, ev.prompt_tokens,
                                                 ev.completion_tokens,
                                                 [ev.logprobs] if ev.logprobs is not None else None)))
                self.m_tokens.labels(self.device.id, t.req.tenant).inc(len(ev.token_ids))
                if ev.finish_reason is not None:
                    finished.append((ev.request_id, ev.finish_reason))
            try:
                await self._publish(items, finished)
            finally:
                with self._pending_lock:
                    self._loop_pending -= 1
            if self.handoffs.ready:
                self.handoffs.published(events)

    async def _publish(self, items: list, finished: list[tuple[str, str]]) -> None:
        """Claim the finished requests' terminal state, publish the chunks, end the requests; retried on Redis
        errors (the gateway drops repeated chunks by ``seq``; a repeated claim by this worker is idempotent)."""
        delay, t0 = 0.1, time.monotonic()
        while True:
            try:
                won = await self.fence.claim_many([(rid, "done") for rid, _ in finished])
                fenced = {rid for (rid, _), ok in zip(finished, won) if not ok}
                if fenced:  # ended elsewhere while we ran (e.g. failed while this worker was stalled)
                    self.m_fenced.labels(self.device.id).inc(len(fenced))
                    log.warning("results_fenced", requests=",".join(sorted(fenced)))
                    items = [(s, c) for s, c in items if c.request_id not in fenced]
                # a request's last chunk is on a replica (and so every chunk before it) before the request ends
                await self.producer.add_many(items, maxlen=TOKENS_MAXLEN, durable=bool(finished))
                for rid, reason in finished:
                    await self._end(rid, "fenced" if rid in fenced else reason)
                return
            except REDIS_ERRORS as e:
                log.warning("publish_failed", error=repr(e))
                if self.shell.stop.is_set() and time.monotonic() - t0 > 5:
                    return
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _end(self, rid: str, outcome: str, error: tuple[int, str, str] | None = None) -> None:
        """A request left this device: tell the gateway (on error), the GMG/scheduler, and ack its entry."""
        t = self.tracker.items.pop(rid, None)
        self.engine_of.pop(rid, None)
        if t is None:
            return
        now = time.time()
        err_msg = None
        if error is not None:
            status, code, message = error
            err_msg = RequestError(msg_id=uuid.uuid4().hex, request_id=rid, tenant=t.req.tenant, status=status,
                                   code=code, message=message, retryable=status >= 500)
        fin = RequestFinished(
            msg_id=uuid.uuid4().hex, request_id=rid, tenant=t.req.tenant, device=self.device.id, outcome=outcome,
            prompt_tokens=len(t.req.prompt_ids), completion_tokens=t.completion_tokens, kv_blocks=t.kv_blocks, ts=now,
            ttft_ms=(t.first_token_ts - t.started_ts) * 1000 if t.first_token_ts else 0.0,
            e2e_ms=(now - t.started_ts) * 1000)

        async def end() -> None:  # every step is idempotent (same claimant, same msg ids)
            if err_msg is not None:
                if await self.fence.claim(rid, "failed"):
                    await self.producer.add(tokens_stream(self.p, t.req.gateway), err_msg, maxlen=TOKENS_MAXLEN,
                                            durable=True)
                else:
                    self.m_fenced.labels(self.device.id).inc()
            # durable: the scheduler releases the request's KV on it, and the entry is acked next
            await self.producer.add(events_stream(self.p), fin, maxlen=EVENTS_MAXLEN, durable=True)
            await self.consumer.ack(t.entry_id)
        await self.retrying(end, "request_end_retry", request_id=rid)

    async def ack_retrying(self, entry_id: str) -> None:
        """Ack an entry of this worker's stream, through Redis trouble."""
        await self.retrying(lambda: self.consumer.ack(entry_id), "ack_retry", entry_id=entry_id)

    async def retrying(self, op, event: str, **fields) -> None:
        """Await ``op()`` until it gets through Redis trouble (backing off to 2 s); given up 5 s into a stop."""
        delay, t0 = 0.1, time.monotonic()
        while True:
            try:
                await op()
                return
            except REDIS_ERRORS as e:
                log.warning(event, error=repr(e), **fields)
                if self.shell.stop.is_set() and time.monotonic() - t0 > 5:
                    return
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    # ------------------------------------------------------------ reports
    async def _heartbeat_loop(self) -> None:
        beats = 0
        while not self.shell.stop.is_set():
            # every HEARTBEAT_S; sooner when a lane's state changed (HEARTBEAT_MIN_S after it) or on stop
            waits = [asyncio.ensure_future(self.shell.stop.wait()), asyncio.ensure_future(self._beat_now.wait())]
            await asyncio.wait(waits, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
            for f in waits:
                f.cancel()
            if self._beat_now.is_set() and not self.shell.stop.is_set():
                await asyncio.sleep(HEARTBEAT_MIN_S)
            self._beat_now.clear()
            beats += 1
            try:
                await self._heartbeat()
                await self._drop_evicted_lanes()
                if beats % 10 == 0 and not await self.redis.hexists(
                        self.gmg.keys.reservations(self.device.id), f"weights:{self.tenant.name}:home"):
                    log.warning("weights_reservation_missing")  # Redis lost its data: account the weights again
                    await self._reserve_weights()
            except REDIS_ERRORS as e:
                log.warning("heartbeat_failed", error=repr(e))

    async def _drop_evicted_lanes(self) -> None:
        """Free the idle lane engines whose cached weights a reservation evicted in the GMG (placements and
        hand-offs make room that way): the GMG's accounting and this device's memory stay the same."""
        if self.lanes is None or not self.lanes.idle_engines():
            return
        fields = await self.redis.hkeys(self.gmg.keys.resident(self.device.id))
        resident = {f.decode() if isinstance(f, bytes) else f for f in fields}
        for t in self.lanes.drop_evicted(resident):
            log.info("lane_weights_evicted", tenant=t)

    def _pending_adds(self) -> dict:
        """Requests assigned here and not yet added to an engine, by engine: None for the home's, the lane's tenant
        for a lane's."""
        out: dict = {}
        for kind, msg in self.pending_ops:
            if kind == "add":
                r = msg.request
                out.setdefault(None if r.tenant == self.tenant.name else r.tenant, []).append(r)
        return out

    def _lane_status(self, pending: dict | None = None) -> list:
        """Each lane's (tenant, outstanding, prompt tokens queued, accepting), with the requests assigned to it that
        its engine has not taken yet."""
        if self.lanes is None:
            return []
        self._lanes_reported = self.lanes.accepting()
        pending = pending or {}
        return [(t, n + len(pending.get(t, ())), q + sum(len(r.prompt_ids) for r in pending.get(t, ())), acc)
                for t, n, q, acc in self.lanes.status()]

    async def _heartbeat(self) -> None:
        now = time.monotonic()
        with self._agg_lock:
            busy = self._busy_s / max(1e-6, now - self._busy_mark)
            self._busy_s, self._busy_mark = 0.0, now
        e = self.engine
        kv_used = (e.kv_blocks_total - e.kv_blocks_free) * e.kv_bytes_per_block
        backlog, prefilling = e.prefill_backlog()
        arrivals = [t.req.arrival_ts for t in map(self.tracker.items.get, prefilling)
                    if t is not None and t.req.arrival_ts > 0]
        # requests assigned here that the engine has not taken yet (they wait in pending_ops while a step runs): the
        # scheduler forgets its own placements older than this heartbeat, so they must be in it
        pending = self._pending_adds()
        home_pending = pending.get(None, [])
        backlog += sum(len(r.prompt_ids) for r in home_pending)
        lanes = self._lane_status(pending)
        self._prefill_reported = {None: backlog, **{t: q for t, _n, q, _acc in lanes}}
        arrivals += [r.arrival_ts for r in home_pending if r.arrival_ts > 0]
        hb = WorkerHeartbeat(msg_id=uuid.uuid4().hex, device=self.device.id, worker_id=self.worker_id,
                             backend=self.device.backend, home_tenant=self.tenant.name, ts=time.time(),
                             state="draining" if self.shell.stop.is_set() else "ready",
                             capacity_bytes=self.device.memory_bytes, weight_bytes=e.weight_bytes,
                             kv_used_bytes=kv_used, kv_total_bytes=e.kv_blocks_total * e.kv_bytes_per_block,
                             running=len(e.running_ids()), queued=len(e.waiting_ids()) + len(home_pending),
                             busy_ratio=min(1.0, busy),
                             queued_prefill_tokens=backlog, prefill_oldest_ts=min(arrivals, default=0.0),
                             guest_lanes=lanes,
                             guest_share=self.lanes.yield_share(self.engine) if self.lanes is not None else 0.0)
        items = [(events_stream(self.p), hb)]
        if self.lease_agent is not None:
            for name, rows, ms in self.lease_agent.drain_segment_stats():
                with self._agg_lock:
                    self.agg.add_segment(name, rows, ms)
        with self._agg_lock:
            rep = self.agg.flush(kv_used)
        if rep is not None:
            items.append((events_stream(self.p), rep))
        await self.producer.add_many(items, maxlen=EVENTS_MAXLEN)
        self.m_busy.labels(self.device.id).set(min(1.0, busy))
        self.m_mem.labels(self.device.id, "kv_used").set(kv_used)
        self.m_mem.labels(self.device.id, "weights").set(e.weight_bytes)
        self.m_mem.labels(self.device.id, "capacity").set(self.device.memory_bytes)


def kv_blocks_for_device(device: DeviceConfig, headroom_fraction: float, weight_bytes: int,
                         bytes_per_block: int, cap_bytes: int | None = None) -> int:
    """KV pool size: what is left under capacity - headroom after the home weights (optionally capped)."""
    budget = int(device.memory_bytes * (1 - headroom_fraction)) - weight_bytes
    if cap_bytes:
        budget = min(budget, cap_bytes)
    return max(0, budget // bytes_per_block)


def lane_kv_blocks(device: DeviceConfig, headroom_fraction: float, home_weight_bytes: int, guest: TenantConfig,
                   fraction: float = 0.25) -> int:
    """KV pool of a guest lane: a fraction of what the device has left after its home weights. The GMG's
    per-request reservations keep the device's total under its limit; this only bounds the lane's own pool."""
    cfg = guest.model.config
    budget = int(device.memory_bytes * (1 - headroom_fraction)) - home_weight_bytes - cfg.weight_bytes()
    return max(1, int(budget * fraction) // (cfg.kv_bytes_per_token() * 16))


def worker_env_threads(device: DeviceConfig) -> int:
    """Torch threads of a CPU worker: ``SLICESCHED_TORCH_THREADS``, else the device's ``threads``."""
    return env_number("SLICESCHED_TORCH_THREADS", device.threads, int, minimum=1)
