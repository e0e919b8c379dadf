"""GMG state service shell: registers the cluster, consumes the events stream (group ``gmg``), applies each event
to the GMG atomically (epoch bump + change entry), and sweeps devices with stale heartbeats and expired leases."""
from __future__ import annotations

import asyncio
import time

import structlog
from prometheus_client import Counter, Gauge

from shared.config import ClusterConfig, Settings, TenantsConfig
from shared.gmg import GMGStore
from shared.gmg.lease_store import expire_leases
from shared.messages import GROUP_GMG, EventsMsg, dead_stream, events_stream
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client
from shared.service import ServiceShell, run_tasks
from shared.streams import ACK, Delivery, StreamConsumer
from services.gmg.core import GMGCore

log = structlog.get_logger()

SWEEP_INTERVAL_S = 0.5


class GMGService:
    """The only writer of GMG structure and live device state."""

    def __init__(self, settings: Settings, cluster: ClusterConfig, tenants: TenantsConfig, name: str = "gmg",
                 *, sweep_interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.s, self.cluster, self.tenants, self.name = settings, cluster, tenants, name
        self.p = settings.prefix
        self.redis = command_client(settings.redis_url, name=f"{name}-cmd")
        self.blocking = blocking_client(settings.redis_url, block_ms=1000, name=f"{name}-blk")
        self.store = GMGStore(self.redis, self.p)
        self.core = GMGCore(self.store.keys, [d.id for d in cluster.devices])
        self.shell = ServiceShell("gmg", name, prefix=self.p, redis=self.redis)
        self.sweep_interval_s = sweep_interval_s
        self.consumer = StreamConsumer(cmd=self.redis, blocking=self.blocking, stream=events_stream(self.p),
                                       group=GROUP_GMG, consumer=name, types=EventsMsg, handler=self._on_event,
                                       dead_stream=dead_stream(self.p), min_idle_ms=30_000)
        reg = self.shell.registry
        self.m_events = Counter("slicesched_gmg_events_total", "Worker events applied to the GMG",
                                ["type", "result"], registry=reg)
        self.m_epoch = Gauge("slicesched_gmg_epoch", "Current GMG epoch", registry=reg)
        self.m_down = Gauge("slicesched_gmg_devices_down", "Devices marked down", registry=reg)
        self.m_leases = Counter("slicesched_gmg_leases_expired_total", "Leases expired by the sweep", registry=reg)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Register the cluster and restore the core's state; retries until Redis answers."""
        delay = 0.1
        while not self.shell.stop.is_set():
            try:
                epoch = await self.store.register_cluster(self.cluster, self.tenants)
                await self._restore()
                self.m_epoch.set(epoch)
                log.info("gmg_registered", devices=len(self.cluster.devices), tenants=len(self.tenants.tenants),
                         epoch=epoch)
                return
            except REDIS_ERRORS as e:
                log.warning("redis_unavailable", error=repr(e))
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _restore(self) -> None:
        k = self.store.keys
        ids = [d.id for d in self.cluster.devices]
        pipe = self.redis.pipeline(transaction=False)
        for d in ids:
            pipe.hgetall(k.device(d))
            pipe.hgetall(k.exec_state(d))
            pipe.hkeys(k.requests(d))
        rows = await pipe.execute()
        dev_rows, exec_rows, running = {}, {}, {}
        for i, d in enumerate(ids):
            dev_rows[d] = _sd(rows[3 * i])
            exec_rows[d] = _sd(rows[3 * i + 1])
            running[d] = [_s(x) for x in rows[3 * i + 2]]
        self.core.load(dev_rows, exec_rows, running, time.time())

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
            log.info("gmg_ready", name=self.name)
            await run_tasks(self.shell, self.consumer.run(self.shell.stop), self.consumer.reclaim_loop(self.shell.stop),
                            self._sweep_loop())
        finally:
            self.shell.stop.set()
            await asyncio.gather(hb, return_exceptions=True)
            await self.shell.close_http()
            await close_quietly(self.redis, self.blocking)

    # ------------------------------------------------------------ handlers
    async def _on_event(self, d: Delivery) -> str:
        change = self.core.on_event(d.msg, time.time())
        kind = type(d.msg).__name__
        if change is None:
            self.m_events.labels(kind, "unchanged").inc()
            return ACK
        op, batch = change
        epoch = await self.store.apply(op, batch)
        self.m_epoch.set(epoch)
        self.m_events.labels(kind, "applied").inc()
        if op == "device_down":
            log.warning("device_down", device=d.msg.device, reason=getattr(d.msg, "reason", ""), epoch=epoch)
        return ACK

    async def sweep_once(self, now: float | None = None) -> int:
        """Mark stale devices down and expire ended leases; returns the number of changes."""
        now = time.time() if now is None else now
        n = 0
        if not await self.redis.exists(self.store.keys.devices):
            # Redis lost the GMG (restarted without persistence, or flushed): register again, restore the core
            log.error("gmg_state_lost_reregistering")
            epoch = await self.store.register_cluster(self.cluster, self.tenants)
            await self._restore()
            self.m_epoch.set(epoch)
            n += 1
        for op, batch in self.core.sweep(now):
            epoch = await self.store.apply(op, batch)
            self.m_epoch.set(epoch)
            n += 1
            log.warning("device_down", reason="heartbeat_timeout", epoch=epoch)
        expired = await expire_leases(self.store, now)
        if expired:
            self.m_leases.inc(len(expired))
            log.info("leases_expired", leases=",".join(expired))
        self.m_down.set(sum(1 for d in self.core.devices.values() if d.state == "down"))
        return n + len(expired)

    async def _sweep_loop(self) -> None:
        while not self.shell.stop.is_set():
            try:
                await self.sweep_once()
            except REDIS_ERRORS as e:
                log.warning("gmg_sweep_error", error=repr(e))
            try:
                await asyncio.wait_for(self.shell.stop.wait(), timeout=self.sweep_interval_s)
            except asyncio.TimeoutError:
                pass


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _sd(h: dict) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in h.items()}
