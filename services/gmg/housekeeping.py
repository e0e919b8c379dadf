"""The GMG service's housekeeping I/O: start-up reconciliation of Redis with the config, and stream expiry.

:meth:`Housekeeper.reconcile` reads everything under the prefix that the config decides (one ``SCAN`` plus
pipelined reads), lets :func:`services.gmg.reconcile.plan_reconcile` decide, and applies the plan: leases through
their atomic close, everything else of the GMG in one atomic ``reconcile`` change (epoch bump + change-stream
entry, so followers replay it), and the derived keys of other services with plain deletes.
:meth:`Housekeeper.expire_streams` deletes the streams of dead gateways, removed devices and idle what-if clients.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from shared.config import ClusterConfig, TenantsConfig
from shared.gmg.lease_store import LeaseStore
from shared.gmg.store import GMGStore
from shared.messages import sim_corrections_key, sim_forecast_key, sim_rates_key
from shared.requests_state import req_key, tenant_stats_key
from shared.service import health_key
from services.gmg.reconcile import (DEVICE_KINDS, Desired, ReconcileOptions, ReconcilePlan, ReconcileRefused,
                                    StoredState, StreamInfo, classify_stream, expired_streams, plan_reconcile)

log = structlog.get_logger()

CHUNK = 1000  # arguments per mutation / command (Lua's unpack has a limit near 8000)


class Housekeeper:
    """Reconciles Redis with the config at start-up and expires streams nobody reads any more."""

    def __init__(self, store: GMGStore, prefix: str, cluster: ClusterConfig, tenants: TenantsConfig,
                 options: ReconcileOptions | None = None) -> None:
        self.store, self.redis, self.p = store, store.redis, prefix
        self.keys = store.keys
        self.want = Desired.from_config(cluster, tenants)
        self.options = options or ReconcileOptions()

    # ------------------------------------------------------------ reconciliation
    async def reconcile(self, stop: asyncio.Event | None = None) -> ReconcilePlan | None:
        """Remove what the config no longer describes. While a worker of the old config still runs, wait up to
        ``wait_s`` for it to stop, then raise :class:`ReconcileRefused` naming it (its work would be lost).
        ``None`` when ``stop`` was set while waiting (nothing removed)."""
        deadline = time.monotonic() + self.options.wait_s
        while True:
            plan = plan_reconcile(await self.read_state(), self.want, self.keys)
            if not plan.conflicts:
                break
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() >= deadline:
                log.error("gmg_reconcile_refused", conflicts=plan.conflicts)
                raise ReconcileRefused(plan.conflicts)
            log.warning("gmg_reconcile_waiting", conflicts=plan.conflicts,
                        wait_s=round(deadline - time.monotonic(), 1))
            await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        if not plan.empty():
            await self.apply(plan)
            why: dict[str, int] = {}
            for _d, _o, reason in plan.release:
                why[reason] = why.get(reason, 0) + 1
            log.info("gmg_reconciled", **plan.summary(), released_by_reason=why,
                     leases=",".join(f"{lid}:{r}" for lid, r in plan.close_leases))
        return plan

    async def read_state(self) -> StoredState:
        st = StoredState()
        k, p = self.keys, self.p
        stats_head, forecast_head = tenant_stats_key(p, ""), sim_forecast_key(p, "")
        async for raw in self.redis.scan_iter(match=f"{_glob(p)}*", count=1000):
            key = _s(raw)
            if key.startswith(k.base):
                st.gmg_keys.append(key)
            elif key.startswith(stats_head):
                st.tenant_stats.append(key[len(stats_head):])
            elif key.startswith(forecast_head):
                st.forecasts.append(key[len(forecast_head):])
        parsed = [k.parse(x) for x in st.gmg_keys]
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(k.devices)
        pipe.smembers(k.tenants)
        pipe.hkeys(sim_rates_key(p))
        pipe.hkeys(sim_corrections_key(p))
        devs, tens, rates, corr = await pipe.execute()
        st.devices, st.tenants = {_s(x) for x in devs}, {_s(x) for x in tens}
        st.rates_fields, st.corrections_fields = [_s(x) for x in rates], [_s(x) for x in corr]
        devices = sorted(st.devices | {i for kind, i in parsed if kind in DEVICE_KINDS} | set(self.want.devices))
        tenants = sorted(st.tenants | {i for kind, i in parsed if kind == "tenant"})
        pipe = self.redis.pipeline(transaction=False)
        for d in devices:
            pipe.hgetall(k.reservations(d))
            pipe.hgetall(k.resident(d))
            pipe.hgetall(k.pins(d))
            pipe.hgetall(k.requests(d))
            pipe.zrange(k.leases(d), 0, -1)
            pipe.zrange(k.finished(d), 0, -1)
            pipe.hgetall(health_key(p, "worker", d))
        for t in tenants:
            pipe.hgetall(k.tenant(t))
        rows = await pipe.execute()
        for i, d in enumerate(devices):
            rsv, res, pins, reqs, lids, fin, hk = rows[7 * i:7 * i + 7]
            st.reservations[d], st.resident[d], st.pins[d] = _sd(rsv), _sd(res), _sd(pins)
            st.running[d], st.lease_index[d], st.finished[d] = _sd(reqs), [_s(x) for x in lids], [_s(x) for x in fin]
            if hk:
                st.workers[d] = _sd(hk)
        for t, row in zip(tenants, rows[7 * len(devices):]):
            st.tenant_rows[t] = _sd(row)
        lease_ids = sorted({i for kind, i in parsed if kind == "lease"} | {x for ids in st.lease_index.values()
                                                                          for x in ids})
        rids = sorted({o[3:] for r in st.reservations.values() for o in r if o.startswith("kv:")}
                      | {rid for r in st.running.values() for rid in r})
        pipe = self.redis.pipeline(transaction=False)
        for lid in lease_ids:
            pipe.hgetall(k.lease(lid))
        for rid in rids:
            pipe.hget(req_key(p, rid), "state")
        rows = await pipe.execute() if lease_ids or rids else []
        for lid, row in zip(lease_ids, rows):
            if row:
                st.leases[lid] = _sd(row)
        for rid, state in zip(rids, rows[len(lease_ids):]):
            st.journeys[rid] = _s(state) if state is not None else ""
        return st

    async def apply(self, plan: ReconcilePlan) -> None:
        leases = LeaseStore(self.store)
        for lid, why in plan.close_leases:
            await leases.close(lid, "revoked", why)
        b = self.store.batch()
        for key in plan.delete:
            b.add("del", key)
        for cmd, table in (("srem", plan.srem), ("hdel", plan.hdel), ("zrem", plan.zrem)):
            for key, members in table.items():
                for i in range(0, len(members), CHUNK):
                    b.add(cmd, key, *members[i:i + CHUNK])
        owners = [(d, o) for d, o, _ in plan.release]
        if owners or len(b):
            await self.store.release_many("reconcile", owners, batch=b)
        pipe = self.redis.pipeline(transaction=False)
        for t in plan.tenant_stats:
            pipe.delete(tenant_stats_key(self.p, t))
        for d in plan.forecasts:
            pipe.delete(sim_forecast_key(self.p, d))
        for key, fields in ((sim_rates_key(self.p), plan.rates_fields),
                            (sim_corrections_key(self.p), plan.corrections_fields)):
            for i in range(0, len(fields), CHUNK):
                pipe.hdel(key, *fields[i:i + CHUNK])
        await pipe.execute()

    # ------------------------------------------------------------ stream expiry
    async def expire_streams(self, now: float | None = None) -> list[str]:
        """Delete expired streams (:func:`services.gmg.reconcile.expired_streams`); returns their names."""
        now = time.time() if now is None else now
        found: list[tuple[str, str, str]] = []
        async for raw in self.redis.scan_iter(match=f"{_glob(self.p)}*", count=1000, _type="STREAM"):
            key = _s(raw)
            kind, owner = classify_stream(key, self.p)
            if kind:
                found.append((key, kind, owner))
        if not found:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key, kind, owner in found:
            pipe.xinfo_stream(key)
            pipe.exists(health_key(self.p, "gateway" if kind == "tokens" else "worker", owner))
        rows = await pipe.execute(raise_on_error=False)
        streams, live_gw, live_wk = [], set(), set()
        for i, (key, kind, owner) in enumerate(found):
            info, alive = rows[2 * i], rows[2 * i + 1]
            if isinstance(info, Exception):  # deleted meanwhile
                continue
            streams.append(StreamInfo(key, kind, owner, _id_ts(info.get("last-generated-id"))))
            if alive is True or (isinstance(alive, int) and alive > 0):
                (live_gw if kind == "tokens" else live_wk).add(owner)
        gone = expired_streams(streams, live_gateways=live_gw, live_workers=live_wk, devices=self.want.devices,
                               now=now, expiry_s=self.options.stream_expiry_s)
        if gone:
            await self.redis.delete(*gone)
            log.info("streams_expired", streams=",".join(gone), expiry_s=self.options.stream_expiry_s)
        return gone


def _id_ts(entry_id) -> float:
    """Seconds since the epoch of a stream entry id (``ms-seq``); 0 for none."""
    try:
        return int(_s(entry_id).split("-", 1)[0]) / 1000.0
    except (ValueError, AttributeError):
        return 0.0


def _glob(prefix: str) -> str:
    """``prefix`` with the characters special in a Redis MATCH pattern escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _sd(h: dict) -> dict[str, str]:
    return {_s(a): _s(b) for a, b in h.items()}
