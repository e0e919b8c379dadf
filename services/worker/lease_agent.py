"""The worker's lease agent: both roles of a lease (DESIGN §4), wired to the worker service.

* **Guest** (``guest_device`` is this device): stage the lease's segments of the tenant (from its checkpoint
  directory when this host has it, else fetched from the home worker, bit for bit), serve the driver's segment
  calls while the lease is active, home work first (:class:`DeviceLock`).
* **Driver** (``home_device`` is this device): allow the guest to fetch the weights, connect to the guest's
  segment server (its address is in the guest's health hash, field ``segment_addr``), wait until the guest
  reports the segments staged, then run steps pipelined in micro-batches with the leased segments remote
  (:func:`pipelined_step`); anything that goes wrong runs at home.

``mode="sequences"`` leases (whole iterations of some sequences on the guest) are not implemented: both roles
log and ignore them. Messages come from the worker's stream handler (event loop); ``step`` runs on the compute
thread; the segment server runs its own threads.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.worker.device_lock import DeviceLock
from services.worker.driver import DriverLink, DriverOptions, HomeWeights, LeaseRemote, fetch_weights
from services.worker.guest import GuestHost, GuestLease, StagedWeights
from services.worker.segment_server import SegmentClient, SegmentServer, TensorMover
from services.worker.segment_wire import FrameError, KVQuery, LeaseStatusQuery, WeightsQuery
from shared.config import ClusterConfig, ConfigError, DeviceConfig, TenantConfig, TenantsConfig, env_number
from shared.gmg import GMGStore, Refused
from shared.gmg.lease_store import LeaseStore
from shared.messages import LeaseGranted, LeaseRevoked
from shared.model.engine import Engine, StepResult
from shared.model.pipeline import pipelined_step
from shared.model.weights import load_state_dict
from shared.redis_util import REDIS_ERRORS
from shared.service import health_key

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LeaseOptions:
    """Guest-execution settings (built once in ``__main__`` from the environment)."""

    driver: DriverOptions = DriverOptions()
    inline_max_bytes: int = 1 << 20  # larger tensors go over the tensor transport
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    cache_bytes: int = 0  # local bound on staged weights (0: only the GMG low-water rule)
    low_water_fraction: float = 0.1  # evict unpinned staged weights while the device has less free than this
    status_poll_s: float = 0.02
    maintain_s: float = 0.5

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LeaseOptions":
        """Options from ``SLICESCHED_SEGMENT_*`` / ``SLICESCHED_LEASE_*`` / ``SLICESCHED_GUEST_CACHE_MB``;
        :class:`~shared.config.ConfigError` naming the variable on a malformed or out-of-range number."""
        e = os.environ if env is None else env
        d = DriverOptions()
        drv = DriverOptions(
            micro_batches=env_number("SLICESCHED_LEASE_MICRO_BATCHES", d.micro_batches, int, minimum=1, env=e),
            timeout_factor=env_number("SLICESCHED_SEGMENT_TIMEOUT_FACTOR", d.timeout_factor, above=0, env=e),
            timeout_floor_ms=env_number("SLICESCHED_SEGMENT_TIMEOUT_FLOOR_MS", d.timeout_floor_ms, minimum=0, env=e),
            cooldown_s=env_number("SLICESCHED_SEGMENT_COOLDOWN_S", d.cooldown_s, minimum=0, env=e))
        return cls(driver=drv, inline_max_bytes=env_number("SLICESCHED_SEGMENT_INLINE_MAX", 1 << 20, int, minimum=0,
                                                           env=e),
                   bind_host=e.get("SLICESCHED_SEGMENT_BIND", "127.0.0.1"),
                   advertise_host=e.get("SLICESCHED_SEGMENT_ADVERTISE") or None,
                   cache_bytes=int(env_number("SLICESCHED_GUEST_CACHE_MB", 0.0, minimum=0, env=e) * 2**20))


class LeaseAgent:
    """Guest and driver sides of leases for a ``cpu``/``cuda`` worker."""

    def __init__(self, *, prefix: str, redis, gmg: GMGStore, cluster: ClusterConfig, device: DeviceConfig,
                 tenant: TenantConfig, tenants: TenantsConfig, engine: Engine, home_busy=lambda: False,
                 options: LeaseOptions | None = None) -> None:
        self.p, self.redis, self.gmg, self.cluster, self.device = prefix, redis, gmg, cluster, device
        self.tenant, self.tenants, self.engine = tenant, tenants, engine
        self.opts = options or LeaseOptions()
        self.lock = DeviceLock(home_busy)
        self.weights = StagedWeights(engine.model.device)
        self.links: dict[str, DriverLink] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._stats: list[tuple[str, int, float]] = []
        self._stats_lock = threading.Lock()
        self._fetchers: dict[str, SegmentClient] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport = None
        self.mover = TensorMover(device.id, inline_max_bytes=self.opts.inline_max_bytes)
        self.server: SegmentServer | None = None
        self.guest: GuestHost | None = None
        self.home_weights: HomeWeights | None = None
        self.kv_exports = None  # the worker's KVExports (lane hand-off): sequences whose KV a home may fetch

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Open the tensor transport and the segment server; publish the server's address."""
        self.loop = asyncio.get_running_loop()
        if len(self.cluster.devices) > 1:
            self.transport = await self._open_transport()
        self.mover = TensorMover(self.device.id, self.transport, self.loop, self.opts.inline_max_bytes)
        configs = {t.name: t.model.config for t in self.tenants.tenants}
        self.guest = GuestHost(self.device.id, configs, self.lock, self.weights, self._weight_source, self.mover,
                               on_segment=self._record)
        self.home_weights = HomeWeights(self.tenant.name, self.engine.model, self.mover)
        wildcard = self.opts.bind_host in ("0.0.0.0", "::", "")
        self.server = SegmentServer(self, self.opts.bind_host or "0.0.0.0", 0,
                                    self.opts.advertise_host or (self.device.host if wildcard else None))
        addr = self.server.start()
        await self.redis.hset(health_key(self.p, "worker", self.device.id), "segment_addr", addr)
        log.info("segment_server_listening", addr=addr, transport=",".join(sorted(
            getattr(self.transport, "transports", {}) or [])), inline_max_bytes=self.opts.inline_max_bytes)

    async def _open_transport(self):
        """The tensor transport for large tensors, or None (everything inline) where it cannot be opened here:
        NCCL needs every member to join at start-up, which the worker does not do yet."""
        from shared.transport import TransportError, make_transport
        try:
            mux = make_transport(self.cluster, self.device.id, bind_host=self.opts.bind_host)
            if "nccl" in mux.transports:
                log.warning("tensor_transport_inline_only", reason="nccl links are not joined by workers yet")
                return None
            await mux.start()
            return mux
        except (ConfigError, TransportError, OSError) as e:
            log.warning("tensor_transport_inline_only", reason=str(e))
            return None

    async def close(self) -> None:
        """End every lease on this worker, close connections, the server and the transport."""
        for t in self._tasks.values():
            t.cancel()
        for link in self.links.values():
            link.state = "ended"
            if link.client is not None:
                link.client.close()
        if self.guest is not None:
            self.guest.close()
        for c in self._fetchers.values():
            c.close()
        if self.server is not None:
            self.server.close()
        if self.transport is not None:
            await self.transport.close()

    def handle(self, msg, payload: bytearray):
        """The segment server's handler: guest calls and status, or weight fetches served as home."""
        if isinstance(msg, WeightsQuery):
            return self.home_weights.handle(msg)  # type: ignore[union-attr]
        if isinstance(msg, KVQuery) and self.kv_exports is not None:
            return self.kv_exports.handle(msg, self.mover)
        return self.guest.handle(msg, payload)  # type: ignore[union-attr]

    # ---------------------------------------------------------------- messages
    async def on_message(self, msg: LeaseGranted | LeaseRevoked) -> None:
        """Take up or end this device's role(s) in a lease (``segments`` mode; other modes are left alone)."""
        me = self.device.id
        if isinstance(msg, LeaseGranted):
            if msg.mode != "segments":
                log.info("lease_mode_not_handled_here", lease_id=msg.lease_id, mode=msg.mode)
                return
            if msg.guest_device == me and self.guest is not None:
                self.guest.grant(msg.lease_id, msg.tenant, msg.home_device, list(msg.segments), msg.end_ts, msg.share)
                log.info("guest_lease_granted", lease_id=msg.lease_id, tenant=msg.tenant, home=msg.home_device,
                         segments=len(msg.segments), share=msg.share)
            link = self.links.get(msg.lease_id)
            if link is not None and link.state != "ended" and msg.home_device == me:
                link.lease = msg  # the same lease re-sent: the scheduler extended its window
                self.home_weights.allow(msg)  # type: ignore[union-attr]
                ev = self._wake.get(msg.lease_id)
                if ev is not None:
                    ev.set()  # the link's keeper re-reads the window
                log.info("driver_lease_extended", lease_id=msg.lease_id, end_ts=msg.end_ts)
            elif msg.home_device == me and msg.tenant == self.tenant.name and link is None:
                self.home_weights.allow(msg)  # type: ignore[union-attr]
                link = DriverLink(msg, on_broken=self._on_broken)
                self.links[msg.lease_id] = link
                self._wake[msg.lease_id] = asyncio.Event()
                self._tasks[msg.lease_id] = asyncio.create_task(self._drive(link))
                log.info("driver_lease_granted", lease_id=msg.lease_id, guest=msg.guest_device,
                         segments=",".join(msg.segments))
        elif isinstance(msg, LeaseRevoked):
            if msg.guest_device == me and self.guest is not None:
                self.guest.revoke(msg.lease_id, msg.reason or "revoked")
            link = self.links.get(msg.lease_id)
            if link is not None:
                self._end_link(link, msg.reason or "revoked")

    def _end_link(self, link: DriverLink, reason: str) -> None:
        if link.state == "ended":
            return
        link.state = "ended"
        if link.client is not None:
            link.client.close()
        ev = self._wake.get(link.lease.lease_id)
        if ev is not None:
            ev.set()
        log.info("driver_lease_ended", lease_id=link.lease.lease_id, reason=reason, calls=link.calls,
                 fallbacks=link.fallbacks, timeouts=link.timeouts)

    def _on_broken(self, link: DriverLink) -> None:  # compute thread
        ev = self._wake.get(link.lease.lease_id)
        if ev is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(ev.set)

    async def _peer_addr(self, device: str) -> str | None:
        v = await self.redis.hget(health_key(self.p, "worker", device), "segment_addr")
        return v.decode() if isinstance(v, bytes) else v

    async def _drive(self, link: DriverLink) -> None:
        """Keep a driver link connected to its guest until the lease ends; reconnect after a failure."""
        lz, backoff = link.lease, 0.05
        ev = self._wake[lz.lease_id]
        while link.state != "ended" and time.time() < link.lease.end_ts:
            lz = link.lease  # a re-sent grant replaces it with a later end
            if link.state == "ready":
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), timeout=max(0.01, lz.end_ts - time.time()))
                except asyncio.TimeoutError:
                    pass
                continue
            client = None
            try:
                addr = await self._peer_addr(lz.guest_device)
                if not addr:
                    raise ConnectionError(f"no segment_addr for {lz.guest_device}")
                client = await asyncio.to_thread(SegmentClient, addr)
                while link.state != "ended" and time.time() < link.lease.end_ts:
                    rep, _ = await asyncio.to_thread(client.request, LeaseStatusQuery(lease_id=lz.lease_id), 2.0)
                    state = getattr(rep, "state", "unknown")
                    if state == "ready":
                        m = self.engine.model
                        err = await asyncio.to_thread(link.warm_up, client, self.mover, m.cfg.hidden_size, m.dtype)
                        if err:
                            raise ConnectionError(f"guest refused the warm-up call: {err}")
                        link.client, link.state, backoff = client, "ready", 0.05
                        log.info("driver_lease_ready", lease_id=lz.lease_id, guest=lz.guest_device, addr=addr,
                                 warmup_ms=round(max(link.rtt_ms.values()), 2))
                        break
                    if state in ("ended", "failed"):
                        self._end_link(link, f"guest reports {state}: {getattr(rep, 'detail', '')}")
                        break
                    await asyncio.sleep(self.opts.status_poll_s)
                if link.client is not client:
                    client.close()
            except (OSError, FrameError, TimeoutError, ConnectionError) + REDIS_ERRORS as e:
                if client is not None:
                    client.close()
                log.info("driver_link_retry", lease_id=lz.lease_id, guest=lz.guest_device, error=repr(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        if link.state != "ended":
            self._end_link(link, "window_ended")

    async def fetch_kv(self, device: str, q: KVQuery, msg=None) -> list:
        """The KV of a sequence ``device`` hands to this worker, over its segment server and the tensor transport."""
        from services.worker.handoff import fetch_kv
        addr = await self._peer_addr(device)
        if not addr:
            raise ConnectionError(f"no segment_addr for {device}")

        def run() -> list:
            client = SegmentClient(addr)
            try:
                return fetch_kv(client, self.mover, q)
            finally:
                client.close()
        return await asyncio.to_thread(run)

    # ---------------------------------------------------------------- guest staging source
    def _weight_source(self, lease: GuestLease, segment: str):
        spec = self.tenants.get(lease.tenant).model
        if spec.checkpoint and Path(spec.checkpoint).is_dir():
            return load_state_dict(spec.checkpoint, spec.config, [segment])
        client = self._fetchers.get(lease.home_device)
        try:
            if client is None or client.closed:
                addr = asyncio.run_coroutine_threadsafe(self._peer_addr(lease.home_device), self.loop).result(5.0)
                if not addr:
                    raise ConnectionError(f"no segment_addr for {lease.home_device}")
                client = self._fetchers[lease.home_device] = SegmentClient(addr)
            return fetch_weights(client, self.mover, WeightsQuery(lease_id=lease.lease_id, tenant=lease.tenant,
                                                                  segment=segment, guest_device=self.device.id))
        except (OSError, FrameError, TimeoutError):
            if client is not None:
                client.close()
            raise

    # ---------------------------------------------------------------- compute thread
    def step(self) -> StepResult:
        """One home step (home priority on the device); pipelined with guests while leases are usable."""
        with self.lock.home():
            now = time.time()
            routes: dict[str, DriverLink] = {}
            for link in list(self.links.values()):
                if link.usable(now):
                    for s in link.lease.segments:
                        routes.setdefault(s, link)
            if not routes:
                return self.engine.step()
            remote = LeaseRemote(routes, self.mover, self.engine.model.device, self.opts.driver)
            return pipelined_step(self.engine, remote, self.opts.driver.micro_batches)

    def _record(self, name: str, rows: int, ms: float) -> None:
        with self._stats_lock:
            self._stats.append((name, rows, ms))

    def drain_segment_stats(self) -> list[tuple[str, int, float]]:
        """Guest segments run since the last call: (``tenant/segment``, rows, ms)."""
        with self._stats_lock:
            out, self._stats = self._stats, []
        return out

    # ---------------------------------------------------------------- upkeep and reports
    async def maintain_loop(self, stop: asyncio.Event) -> None:
        """Expire leases, forget old ones, evict cached weights when the device needs the memory."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.opts.maintain_s)
            except asyncio.TimeoutError:
                pass
            now = time.time()
            if self.guest is not None:
                self.guest.expire()
                self.guest.forget_ended()
            for lid, link in list(self.links.items()):
                if link.state == "ended" and now > link.lease.end_ts + 60:
                    self.links.pop(lid, None)
                    self._wake.pop(lid, None)
                    self._tasks.pop(lid, None)
            try:
                await self.evict_if_needed()
            except REDIS_ERRORS as e:
                log.warning("eviction_check_failed", error=repr(e))

    async def evict_if_needed(self) -> list[tuple[str, str]]:
        """Drop unpinned staged segments (LRU first, in the GMG too) while the device's free memory is under the
        low-water mark or the local cache bound is exceeded."""
        if self.guest is None or not self.weights.entries():
            return []
        # the scheduler evicts unpinned cached weights in the GMG when a lease needs the room: free ours too
        fields = await self.gmg.redis.hkeys(self.gmg.keys.resident(self.device.id))
        resident = {(f.decode() if isinstance(f, bytes) else f) for f in fields}
        pinned = self.guest.pinned()
        for tenant, seg, nbytes in self.weights.evictable(pinned):
            if f"{tenant}|{seg}" not in resident:
                self.weights.drop(tenant, seg)
                log.info("staged_weights_evicted", tenant=tenant, segment=seg, bytes=nbytes, gmg="evicted_there")
        row = await self.gmg.device(self.device.id)
        need = 0
        if row.get("limit"):
            free = int(float(row["limit"])) - int(float(row.get("reserved") or 0))
            need = int(self.opts.low_water_fraction * self.device.memory_bytes) - free
        if self.opts.cache_bytes:
            need = max(need, self.weights.nbytes - self.opts.cache_bytes)
        evicted = []
        for tenant, seg, nbytes in self.weights.evictable(self.guest.pinned()):
            if need <= 0:
                break
            res = await LeaseStore(self.gmg).evict(self.device.id, tenant, [seg])
            if isinstance(res, Refused) and res.reason == "pinned":
                continue
            self.weights.drop(tenant, seg)
            need -= nbytes
            evicted.append((tenant, seg))
            log.info("staged_weights_evicted", tenant=tenant, segment=seg, bytes=nbytes,
                     gmg="refused:" + res.reason if isinstance(res, Refused) else "freed")
        return evicted

    def health_fields(self) -> dict:
        """Lease state for the worker's health hash (plain fields a person can read)."""
        s = self.lock.stats
        links = list(self.links.values())
        guests = list(self.guest.leases.values()) if self.guest else []
        return {
            "segment_addr": self.server.addr if self.server else "",
            "leases_driver": ",".join(f"{x.lease.lease_id}:{x.state}" for x in links),
            "leases_guest": ",".join(f"{x.lease_id}:{x.state}" for x in guests),
            "remote_calls": sum(x.calls for x in links), "remote_fallbacks": sum(x.fallbacks for x in links),
            "remote_timeouts": sum(x.timeouts for x in links),
            "guest_served": sum(x.served for x in guests), "guest_busy_ms": round(s.guest_busy_s * 1e3, 2),
            "guest_run_max_ms": round(s.guest_run_max_s * 1e3, 3),
            "home_wait_max_ms": round(s.home_wait_max_s * 1e3, 3),
            "home_wait_on_guest_max_ms": round(s.home_wait_on_guest_max_s * 1e3, 3),
            "home_waits_on_guest": s.home_waits_on_guest, "yield_lag_max_ms": round(s.yield_lag_max_s * 1e3, 3), "guest_refused_busy": s.guest_refused,
            "staged_bytes": self.weights.nbytes, "staged_segments": len(self.weights.entries()),
        }
