"""Simulator service shell: follows the GMG into a twin of the live cluster."""
from __future__ import annotations

import asyncio

import structlog
from prometheus_client import Gauge

from shared.config import ClusterConfig, Settings, TenantsConfig
from shared.gmg.follower import GMGFollower
from shared.redis_util import REDIS_ERRORS, blocking_client, close_quietly, command_client
from shared.service import ServiceShell, run_tasks

log = structlog.get_logger()


class SimulatorService:
    def __init__(self, settings: Settings, cluster: ClusterConfig, tenants: TenantsConfig,
                 name: str = "simulator") -> None:
        self.s, self.cluster, self.tenants, self.name = settings, cluster, tenants, name
        self.p = settings.prefix
        self.redis = command_client(settings.redis_url, name=f"{name}-cmd")
        self.blocking = blocking_client(settings.redis_url, block_ms=1000, name=f"{name}-gmg")
        self.follower = GMGFollower(self.redis, self.p, blocking=self.blocking, block_ms=1000)
        self.shell = ServiceShell("simulator", name, prefix=self.p, redis=self.redis)
        self.m_epoch = Gauge("slicesched_sim_twin_epoch", "GMG epoch of the simulator's twin",
                             registry=self.shell.registry)

    async def run(self) -> None:
        self.shell.install_signal_handlers()
        await self.shell.serve_http("127.0.0.1" if self.s.gateway_host == "127.0.0.1" else "0.0.0.0",
                                    self.s.metrics_port)
        log.info("metrics_listening", port=self.shell.port)
        hb = asyncio.ensure_future(self.shell.heartbeat_loop())
        try:
            await self._load()
            self.shell.ready = True
            log.info("simulator_ready", epoch=self.follower.epoch)
            await run_tasks(self.shell, self.follower.run(self.shell.stop), self._gauge_loop())
        finally:
            self.shell.stop.set()
            await asyncio.gather(hb, return_exceptions=True)
            await self.shell.close_http()
            await close_quietly(self.redis, self.blocking)

    async def _load(self) -> None:
        delay = 0.1
        while not self.shell.stop.is_set():
            try:
                await self.follower.load()
                return
            except REDIS_ERRORS as e:
                log.warning("redis_unavailable", error=repr(e))
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _gauge_loop(self) -> None:
        while not self.shell.stop.is_set():
            self.m_epoch.set(self.follower.epoch)
            try:
                await asyncio.wait_for(self.shell.stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
