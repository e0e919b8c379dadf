"""Simulator service shell: follows the GMG into a twin, reads arrivals from the requests stream and measured
segment times from the events stream (group ``simulator``), publishes forecasts, rates and corrections, the
versioned ``sim:steering`` copy the scheduler's what-if applies, and answers what-if RPCs (``sim:rpc``, group
``simulator``; replies on ``sim:reply:{client}``)."""
from __future__ import annotations

import asyncio
import time

import structlog
from prometheus_client import Counter, Gauge, Histogram

from shared.codec import DecodeError, decode
from shared.config import ClusterConfig, Settings, TenantsConfig
from shared.gmg.follower import GMGFollower
from shared.messages import (GROUP_SIMULATOR, EventsMsg, InferenceRequest, RequestsMsg, SimRpcMsg, WhatIfReply,
                             dead_stream, events_stream, requests_stream, sim_corrections_key, sim_forecast_key,
                             sim_rates_key, sim_reply_stream, sim_rpc_stream,
                             sim_steering_key)
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client
from shared.service import ServiceShell, run_tasks
from shared.streams import ACK, Delivery, StreamConsumer, StreamProducer, entry_payload, pace
from services.simulator.core import SimulatorCore
from services.simulator.evaluate import TwinView
from services.simulator.forecast import forecast_device

log = structlog.get_logger()

REPLY_MAXLEN = 1000
FORECAST_TTL_S = 10
STEP_GAP_S = 0.001  # pause between the per-device steps of a refresh or publish, so a what-if query waits < 1 step
PUBLISH_CHUNK = 8  # devices per forecast-publish pipeline
# the GMG changes and the requests stream are read at most this often (a full read goes on at once): the twin is
# rebuilt at most every refresh_interval_s anyway, and one round trip per change cost a busy mesh's CPU
FOLLOW_INTERVAL_S = 0.05


class SimulatorService:
    """The twin, forecasts and what-if answers of the live mesh."""

    def __init__(self, settings: Settings, cluster: ClusterConfig, tenants: TenantsConfig, name: str = "simulator",
                 *, refresh_interval_s: float = 0.25, publish_interval_s: float = 0.5,
                 step_gap_s: float = STEP_GAP_S) -> None:
        self.s, self.cluster, self.tenants, self.name = settings, cluster, tenants, name
        self.p = settings.prefix
        self.redis = command_client(settings.redis_url, name=f"{name}-cmd")
        self._blocking = [blocking_client(settings.redis_url, block_ms=1000, name=f"{name}-{x}")
                          for x in ("gmg", "req", "ev", "rpc")]
        self.follower = GMGFollower(self.redis, self.p, blocking=self._blocking[0], block_ms=1000,
                                    min_interval_s=FOLLOW_INTERVAL_S)
        self.core = SimulatorCore(cluster, tenants)
        self.producer = StreamProducer(self.redis)
        self.shell = ServiceShell("simulator", name, prefix=self.p, redis=self.redis)
        self.refresh_interval_s, self.publish_interval_s = refresh_interval_s, publish_interval_s
        self.step_gap_s = step_gap_s
        self._steer_version: int | None = None  # last version of sim:steering written (None: not read yet)
        self.events = StreamConsumer(cmd=self.redis, blocking=self._blocking[2], stream=events_stream(self.p),
                                     group=GROUP_SIMULATOR, consumer=name, types=EventsMsg, handler=self._on_event,
                                     dead_stream=dead_stream(self.p), min_idle_ms=30_000)
        self.rpc = StreamConsumer(cmd=self.redis, blocking=self._blocking[3], stream=sim_rpc_stream(self.p),
                                  group=GROUP_SIMULATOR, consumer=name, types=SimRpcMsg, handler=self._on_query,
                                  dead_stream=dead_stream(self.p), block_ms=1000, noack=True)
        reg = self.shell.registry
        self.m_epoch = Gauge("slicesched_sim_twin_epoch", "GMG epoch of the simulator's twin", registry=reg)
        self.m_error = Gauge("slicesched_sim_prediction_error",
                             "EWMA of |measured - predicted| / measured segment time after correction (simulated)",
                             ["device", "op"], registry=reg)
        self.m_factor = Gauge("slicesched_sim_correction_factor", "Online correction factor (measured / model)",
                              ["device", "op"], registry=reg)
        self.m_queries = Counter("slicesched_sim_whatif_total", "What-if queries", ["result"], registry=reg)
        self.m_compute = Histogram("slicesched_sim_whatif_compute_seconds", "What-if evaluation time per query",
                                   registry=reg, buckets=(.0002, .0005, .001, .002, .005, .01, .05))

    # ------------------------------------------------------------ lifecycle
    async def run(self, *, serve_http: bool = True) -> None:
        self.shell.install_signal_handlers()
        if serve_http:
            await self.shell.serve_http(self.s.metrics_host,
                                        self.s.metrics_port)
            log.info("metrics_listening", port=self.shell.port)
        hb = asyncio.ensure_future(self.shell.heartbeat_loop())
        try:
            await self.start()
            self.shell.ready = True
            log.info("simulator_ready", epoch=self.follower.epoch, devices=len(self.cluster.devices))
            await run_tasks(self.shell, self.follower.run(self.shell.stop), self._requests_loop(),
                            self.events.run(self.shell.stop), self.events.reclaim_loop(self.shell.stop),
                            self.rpc.run(self.shell.stop), self.rpc.reclaim_loop(self.shell.stop),
                            self._refresh_loop(), self._publish_loop())
        finally:
            self.shell.stop.set()
            await asyncio.gather(hb, return_exceptions=True)
            await self.shell.close_http()
            await close_quietly(self.redis, *self._blocking)

    async def start(self) -> None:
        """Load the twin (retrying until Redis answers) and compute the first forecasts."""
        delay = 0.1
        while not self.shell.stop.is_set():
            try:
                await self.follower.load()
                await self._read_recent_requests()
                await self.refresh()
                return
            except REDIS_ERRORS as e:
                log.warning("redis_unavailable", error=repr(e))
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    # ------------------------------------------------------------ twin
    async def refresh(self) -> TwinView:
        """Rebuild the twin's work and forecasts one device at a time, pausing ``step_gap_s`` between devices: a
        what-if query that arrives meanwhile is answered in the pause instead of sharing every loop turn with a
        refresh step (a bare ``sleep(0)`` lets the next step run on each of the turns the query's read needs)."""
        now = time.time()
        snap = self.follower.snapshot
        self.core.evaluator.whatif.update()
        await asyncio.sleep(self.step_gap_s)
        rates = self.core.twin.rates.rates(now)
        works, forecasts = {}, {}
        for d in snap.devices:
            w = works[d] = self.core.twin.work_of(snap, d, now, rates)
            forecasts[d] = forecast_device(w, self.core.horizon_s)
            await asyncio.sleep(self.step_gap_s)
        cluster = self.core.twin.cluster_snapshot(snap, works, now)
        self.core.view = TwinView(snap.epoch, snap, works, forecasts, self.core.horizon_s, cluster)
        self.core.view_ts = now
        self.m_epoch.set(snap.epoch)
        return self.core.view

    async def _refresh_loop(self) -> None:
        while not self.shell.stop.is_set():
            view = self.core.view
            stale = view is None or view.epoch != self.follower.epoch or time.time() - self.core.view_ts >= 1.0
            try:
                if stale:
                    await self.refresh()
            except Exception:  # a bad twin state must not stop answering with the previous view
                log.exception("sim_refresh_failed")
            await _sleep(self.shell.stop, self.refresh_interval_s)

    async def publish(self) -> None:
        """Write forecasts, rates and corrections (plain hashes, see docs/redis-schema.md); forecasts in pipelines
        of ``PUBLISH_CHUNK`` devices with a pause between them (see :meth:`refresh`)."""
        now = time.time()
        devices = self.core.forecast_devices()
        for i in range(0, len(devices), PUBLISH_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for d in devices[i:i + PUBLISH_CHUNK]:
                key = sim_forecast_key(self.p, d)
                pipe.delete(key)
                pipe.hset(key, mapping=self.core.forecast_fields_of(d, now))
                pipe.expire(key, FORECAST_TTL_S)
            await pipe.execute()
            await asyncio.sleep(self.step_gap_s)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(sim_rates_key(self.p), mapping=self.core.rates_fields(now))
        corr = self.core.corrections_fields()
        if corr:
            pipe.hset(sim_corrections_key(self.p), mapping=corr)
        await pipe.execute()
        await self.publish_steering(now)

    async def publish_steering(self, now: float | None = None) -> int:
        """Replace ``sim:steering`` whole (one MULTI: readers see one version or the next, never a mix) with a
        new version of what the scheduler's what-if takes from this service; returns the version."""
        now = time.time() if now is None else now
        key = sim_steering_key(self.p)
        if self._steer_version is None:  # continue after a restart's last version, so readers see a change
            raw = await self.redis.hget(key, "version")
            self._steer_version = int(raw) if raw and raw.isdigit() else 0
        copy = self.core.steering_copy(self._steer_version + 1, now)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=copy.to_fields())
        await pipe.execute()
        self._steer_version = copy.version
        return copy.version

    async def _publish_loop(self) -> None:
        while not self.shell.stop.is_set():
            try:
                await self.publish()
            except REDIS_ERRORS as e:
                log.warning("sim_publish_error", error=repr(e))
            await _sleep(self.shell.stop, self.publish_interval_s)

    # ------------------------------------------------------------ inputs
    async def _read_recent_requests(self) -> None:
        """Arrivals of the last rate window (so rates survive a restart)."""
        start = int((time.time() - self.core.twin.rates.window_s) * 1000)
        self._req_pos = f"{start}-0"
        while True:
            resp = await self.redis.xread({requests_stream(self.p): self._req_pos}, count=1000)
            n = self._take_requests(resp)
            if n < 1000:
                return

    def _take_requests(self, resp) -> int:
        n = 0
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                n += 1
                self._req_pos = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                raw = entry_payload(fields)
                try:
                    msg = decode(raw, RequestsMsg) if raw is not None else None
                except DecodeError:
                    continue  # the scheduler dead-letters it; we only lose one arrival sample
                if isinstance(msg, InferenceRequest):
                    self.core.on_request(msg)
        return n

    async def _requests_loop(self) -> None:
        """Follow the requests stream without a group (read-only: never holds back the scheduler's trimming)."""
        client = self._blocking[1]
        while not self.shell.stop.is_set():
            try:
                started = time.monotonic()
                resp = await client.xread({requests_stream(self.p): self._req_pos}, count=500, block=1000)
                self._take_requests(resp)
                if sum(len(entries) for _s, entries in resp or []) < 500:
                    await pace(self.shell.stop, started, FOLLOW_INTERVAL_S)
            except REDIS_ERRORS as e:
                log.warning("sim_requests_read_error", error=repr(e))
                await _sleep(self.shell.stop, 0.5)

    async def _on_event(self, d: Delivery) -> str:
        for device, op, err in self.core.on_event(d.msg):
            self.m_error.labels(device, op).set(err)
            self.m_factor.labels(device, op).set(self.core.corrections.factor(device, op))
        return ACK

    async def _on_query(self, d: Delivery) -> str:
        q = d.msg
        now = time.time()
        if q.deadline_ts and now > q.deadline_ts:
            self.m_queries.labels("expired").inc()
            return ACK  # the client has given up on it
        try:
            reply = self.core.answer(q, now)
        except Exception as e:  # one bad query gets an error reply, never kills the service
            log.exception("whatif_failed", query_id=q.query_id)
            reply = WhatIfReply(msg_id=q.msg_id, query_id=q.query_id, epoch=self.follower.epoch,
                                error=f"internal_error: {e!r}"[:500])
        self.m_compute.observe(reply.compute_ms / 1e3)
        self.m_queries.labels("error" if reply.error else "ok").inc()
        await self.producer.add(sim_reply_stream(self.p, q.client), reply, maxlen=REPLY_MAXLEN)
        return ACK


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
