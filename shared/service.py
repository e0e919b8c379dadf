"""The shell every service shares: stop flag on SIGTERM/SIGINT, a health key with TTL in Redis, and a small
aiohttp server for ``GET /health`` (liveness), ``GET /ready`` (readiness) and ``GET /metrics`` (Prometheus text).

The decisions live in each service's ``core.py``; this module only does I/O plumbing.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from typing import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from shared.config import env_number
from shared.redis_util import REDIS_ERRORS

log = structlog.get_logger()


def instance_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def health_key(prefix: str, service: str, name: str) -> str:
    return f"{prefix}health:{service}:{name}"


_SHELLS: list["ServiceShell"] = []


def _stop_all(sig: int) -> None:
    for shell in _SHELLS:
        shell._on_signal(sig)


class ServiceShell:
    """Owns the stop event, signal handlers, the health key and the /health + /metrics endpoint."""

    def __init__(self, service: str, name: str, *, prefix: str, redis, registry: CollectorRegistry | None = None,
                 drain_s: float | None = None, health_ttl_s: int = 5) -> None:
        self.service, self.name, self.prefix, self.redis = service, name, prefix, redis
        self.registry = registry or CollectorRegistry()
        self.stop = asyncio.Event()
        # SLICESCHED_DRAIN_S is validated by Settings.from_env when the service starts
        self.drain_s = env_number("SLICESCHED_DRAIN_S", 20.0, float, minimum=0) if drain_s is None else drain_s
        self.health_ttl_s = health_ttl_s
        self.started_ts = time.time()
        self.ready = False
        self.redis_ok = False
        self._runner: web.AppRunner | None = None
        self.port = 0

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT set the stop flag of every shell in this process (one process may host several
        services, e.g. emulated devices), since a loop keeps only one handler per signal."""
        _SHELLS.append(self)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, _stop_all, sig)
            except (NotImplementedError, RuntimeError):
                pass

    def _on_signal(self, sig: int) -> None:
        if not self.stop.is_set():
            log.info("stop_requested", signal=signal.Signals(sig).name, name=self.name)
        self.stop.set()

    # ------------------------------------------------------------ health + metrics endpoint
    def health(self) -> dict:
        return {"status": "ok" if (self.ready and self.redis_ok) else "starting" if not self.ready else "degraded",
                "service": self.service, "name": self.name, "uptime_s": round(time.time() - self.started_ts, 1),
                "redis": self.redis_ok}

    async def _h_health(self, request: web.Request) -> web.Response:
        """Liveness: the service runs and reaches Redis."""
        h = self.health()
        return web.json_response(h, status=200 if h["status"] == "ok" else 503)

    async def _h_ready(self, request: web.Request) -> web.Response:
        """Readiness: started (state restored, registered), reaches Redis and is not stopping. The gateway serves
        its own ``/ready`` (a live worker for each of its tenants)."""
        h = self.health()
        ok = h["status"] == "ok" and not self.stop.is_set()
        return web.json_response({**h, "status": "ready" if ok else "not_ready"}, status=200 if ok else 503)

    async def _h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._h_health)
        app.router.add_get("/ready", self._h_ready)
        app.router.add_get("/metrics", self._h_metrics)

    async def serve_http(self, host: str, port: int) -> int:
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def close_http(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ health key
    async def heartbeat_loop(self, extra: Callable[[], dict] | None = None, interval_s: float = 1.0) -> None:
        key = health_key(self.prefix, self.service, self.name)
        while not self.stop.is_set():
            try:
                fields = {"service": self.service, "name": self.name, "pid": os.getpid(), "ts": time.time(),
                          "port": self.port, "ready": int(self.ready)}
                if extra:
                    fields.update(extra())
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
                pipe.expire(key, self.health_ttl_s)
                await pipe.execute()
                self.redis_ok = True
            except REDIS_ERRORS as e:
                if self.redis_ok:
                    log.warning("redis_unreachable", error=repr(e))
                self.redis_ok = False
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
        try:
            await self.redis.delete(key)
        except REDIS_ERRORS:
            pass


async def run_tasks(shell: ServiceShell, *coros: Awaitable[None]) -> None:
    """Run the service's loops until the stop flag is set or one of them fails; then cancel the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    stopper = asyncio.ensure_future(shell.stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not stopper and t.exception() is not None:
            log.error("service_task_failed", error=repr(t.exception()))
    shell.stop.set()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=shell.drain_s)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    stopper.cancel()
