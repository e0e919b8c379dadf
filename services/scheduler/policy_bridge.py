"""The live side of the shared policies: build the same :class:`ClusterSnapshot` the simulator builds, from GMG
state and the scheduler's own queues, and apply the policy's lease actions through the GMG's atomic commits."""
from __future__ import annotations

import asyncio
import math
import time
import uuid

import structlog

from shared.config import ClusterConfig, TenantsConfig
from shared.gmg import GMGStore, Refused, Room
from shared.gmg.lease_store import Lease, LeaseStore
from shared.costmodel.sla import RequestTargets
from shared.messages import LeaseGranted, LeaseRevoked, RequestFinished, worker_stream
from shared.model.graph import ModelGraph
from shared.policies import (ClusterSnapshot, DeviceState, ExtendLease, GrantLease, LeaseState, RevokeLease,
                             TenantState)
from shared.policies.snapshot import LeaseTable
from shared.policies.attainment import Attainment, missed
from shared.policies.rates import ArrivalStats
from shared.streams import StreamProducer
from services.scheduler.core import DeviceView, SchedulerCore

log = structlog.get_logger()


_NO_ROW: dict[str, str] = {}  # a device the GMG has no row for (never modified)


class SnapshotBuilder:
    """Turns the scheduler's view (GMG device rows, its queues and placements, active leases) into a snapshot.

    Incremental: it keeps one :class:`ClusterSnapshot` and updates it in place, so a decision costs the devices
    whose inputs changed, not the cluster. Per build it makes one pass over the placements and the leases, reads
    each home tenant's queue once (only when it changed), and recomputes a device's fields only from what it can
    have changed through: its GMG row (replaced on every device refresh), its view (heartbeats and placements) and
    its tenant's queue. A device whose fields come out equal keeps its :class:`DeviceState`; one that changed is
    updated in place and reported to the snapshot (``touch``), which is therefore ``tracked`` (the policies may
    keep indexes over it). The snapshot returned is the same object every time: use it before the next build."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, core: SchedulerCore) -> None:
        self.cluster, self.tenants, self.core = cluster, tenants, core
        start = time.time()
        self.rates = {t.name: ArrivalStats(start=start) for t in tenants.tenants}
        self.attainment = {t.name: Attainment() for t in tenants.tenants}
        self._targets = {t.name: RequestTargets(t.sla, t.model.config) for t in tenants.tenants}
        self.home_of = tenants.home_of()
        self.n_home = {t.name: max(1, len(t.home_devices)) for t in tenants.tenants}
        self._parsed: dict[str, tuple[str, dict]] = {}  # device -> (raw "resident" field, parsed)
        self._rows: dict[str, tuple[dict, tuple]] = {}  # device -> (GMG row, the fields taken from it)
        self._queues: dict[str, tuple[tuple, int, float, int]] = {}  # tenant -> (key, depth, oldest, tokens)
        self._routing: tuple[str, str] | None = None  # (tenant, request id) of the request being routed
        self._fields: dict[str, tuple] = {}  # device -> the fields its DeviceState holds
        self._seen: dict[str, tuple] = {}  # device -> (row, view, view version, queue version, context, share)
        self._snap: ClusterSnapshot | None = None
        # what the last build saw, to find the devices whose inputs may have changed since (see _changed)
        self._dev = {d.id: d for d in cluster.devices}
        self._homes: dict[str, list[str]] = {}
        for did, t in self.home_of.items():
            self._homes.setdefault(t, []).append(did)
        self._dirty_views: set[str] = set()  # the views report their changes here (DeviceView.touch)
        self._views: object = None
        self._n_views = -1
        self._rows_obj: object = None
        self._rows_seen: dict[str, dict] = {}
        self._qver: dict[str, int] = {}
        self._routing_changed: set = set()  # (tenant, request id) routed in this build or the last
        self._shares: dict[str, float] = {}

    def _resident(self, device: str, raw: str) -> dict[tuple[str, str], int]:
        """The device row's ``resident`` field (``tenant|segment,…``) as a dict, parsed once per change (the same
        dict object until it changes: read it, do not modify it)."""
        hit = self._parsed.get(device)
        if hit is not None and hit[0] == raw:
            return hit[1]
        parsed = {tuple(f.split("|", 1)): 1 for f in raw.split(",") if "|" in f}
        self._parsed[device] = (raw, parsed)
        return parsed

    def _row_fields(self, d, row: dict) -> tuple:
        """(running or None without a row, headroom, used, evictable, busy by ratio, resident) of a GMG row."""
        headroom = d.memory_bytes - int(row.get("limit") or d.memory_bytes * (1 - self.cluster.headroom_fraction))
        return (int(row.get("running") or 0) if row else None, headroom, int(row.get("reserved") or 0),
                int(row.get("evictable") or 0), float(row.get("busy_ratio") or 0) > 0.5,
                self._resident(d.id, row.get("resident") or ""))

    def _qkey(self, tenant: str) -> tuple[int, str | None]:
        """What a tenant's queue terms are computed from: its queue's version and the request being routed, when
        it is this tenant's (``build(routing=…)``)."""
        r = self._routing
        return self.core.queues.versions.get(tenant, 0), (r[1] if r is not None and r[0] == tenant else None)

    def _queue(self, tenant: str) -> tuple[tuple, int, float, int]:
        """(key, depth, oldest enqueue time, prompt tokens) of a tenant's queue without the request being routed,
        re-read when either changed."""
        key = self._qkey(tenant)
        hit = self._queues.get(tenant)
        if hit is not None and hit[0] == key:
            return hit
        skip = key[1]
        q = [p for rid, p in self.core.queues.queues.get(tenant, {}).items() if rid != skip]
        hit = self._queues[tenant] = (key, len(q), min((p.enqueued_ts for p in q), default=math.inf),
                                      sum(len(p.req.prompt_ids) for p in q))
        return hit

    def request_ended(self, msg: RequestFinished, arrival_ts: float) -> None:
        """Count a finished request in its tenant's recent attainment, as the simulator counts it
        (``shared/policies/attainment.py``): TTFT from its arrival at the gateway (``arrival_ts``; from its start
        on the worker when unknown), TPOT over the tokens after the first. A cancelled request does not count."""
        a = self.attainment.get(msg.tenant)
        if a is None or msg.outcome == "cancelled":
            return
        if msg.outcome == "failed":
            a.observe(msg.ts, True)
            return
        if msg.completion_tokens < 1 or msg.ttft_ms <= 0:  # no first token on record: nothing to judge
            return
        first = msg.ts - (msg.e2e_ms - msg.ttft_ms) / 1e3  # when its first token came
        ttft = first - arrival_ts if 0 < arrival_ts <= first else msg.ttft_ms / 1e3
        tpot = (msg.ts - first) / (msg.completion_tokens - 1) if msg.completion_tokens > 1 else None
        a.observe(msg.ts, missed(ttft, tpot, self._targets[msg.tenant](msg.prompt_tokens, msg.completion_tokens)))

    def build(self, now: float, views: dict[str, DeviceView], rows: dict[str, dict[str, str]],
              assigned: dict[str, tuple], leases: dict[str, LeaseState],
              routing: tuple[str, str] | None = None) -> ClusterSnapshot:
        """The snapshot for a decision; ``routing`` — (tenant, request id) of a queued request about to be routed —
        leaves that request out of its homes' queues, as the simulator routes an arrival before it queues on a
        device (the tenant's own ``queued`` still counts it, as there)."""
        if routing != self._routing:
            self._routing_changed = {t for t in (routing, self._routing) if t is not None}
            self._routing = routing
        # an AssignedTable keeps them; with its homes known, a device's own tenant's alone (not its lanes' requests)
        own: dict[str, int] | None = getattr(assigned, "own", None) if getattr(assigned, "home_of", None) else None
        per_dev_ctx: dict[str, int] | None = getattr(assigned, "own_ctx" if own is not None else "ctx", None)
        running_of: dict[str, int] | None = getattr(assigned, "per_tenant", None)
        if per_dev_ctx is None or running_of is None:
            per_dev_ctx, running_of = {}, {}
            for dev, req, _w in assigned.values():
                per_dev_ctx[dev] = per_dev_ctx.get(dev, 0) + len(req.prompt_ids) + req.max_tokens // 2
                running_of[req.tenant] = running_of.get(req.tenant, 0) + 1
        shares: dict[str, float] = {}
        for lz in leases.values():
            shares[lz.guest_device] = shares.get(lz.guest_device, 0) + lz.share
        snap = self._snap
        if snap is None:
            snap = self._snap = self._first(now)
        changed = self._changed(views, rows, assigned, shares)
        devices, fields, seen = snap.devices, self._fields, self._seen
        for d in (self.cluster.devices if changed is None else [self._dev[did] for did in changed]):
            did = d.id
            row, v = rows.get(did, _NO_ROW), views.get(did)
            home = self.home_of.get(did)
            # everything this device's fields are computed from; unchanged since the last build: nothing to do
            inputs = (row, v, v.version if v is not None else 0, self._qkey(home) if home else 0,
                      per_dev_ctx.get(did, 0), shares.get(did, 0))
            last = seen.get(did)
            if last is not None and last[0] is row and last[1] is v and last[2:] == inputs[2:]:
                continue
            seen[did] = inputs
            hit = self._rows.get(did)
            if hit is None or hit[0] is not row:
                hit = self._rows[did] = (row, self._row_fields(d, row))
            row_running, headroom, used, evictable, busy_ratio, resident = hit[1]
            if home:
                _, qn, q_oldest, q_tokens = self._queue(home)
                n_home = self.n_home[home]
            else:
                qn, q_oldest, q_tokens, n_home = 0, math.inf, 0, 1
            if v is not None:
                w_queued, w_prefill, w_oldest = v.backlog()
                v_assigned = own.get(did, 0) if own is not None else v.assigned
                running = row_running if row_running is not None else v_assigned
                f = (headroom, used, evictable, qn // n_home + w_queued, max(running, v_assigned),
                     q_tokens // n_home + w_prefill, per_dev_ctx.get(did, 0), min(q_oldest, w_oldest),
                     busy_ratio or bool(v_assigned), shares.get(did, 0), v.guest_share, v.lanes(), resident,
                     not v.up)
            else:
                running = row_running if row_running is not None else 0
                f = (headroom, used, evictable, qn // n_home, max(running, 0), q_tokens // n_home,
                     per_dev_ctx.get(did, 0), min(q_oldest, math.inf), busy_ratio, shares.get(did, 0), 0.0, {},
                     resident, True)
            if fields.get(did) != f:
                fields[did] = f
                st = devices[did]
                (st.headroom_bytes, st.used_bytes, st.evictable_bytes, st.queued, st.running,
                 st.queued_prefill_tokens, st.decode_kv_tokens, st.oldest_pending_s, st.busy, st.guest_share,
                 st.guest_yield, st.guest_engines, st.resident, st.draining) = f
                snap.touch(st)
        queues = self.core.queues
        for t in self.tenants.tenants:
            r, ts = self.rates[t.name], snap.tenants[t.name]
            ts.queued, ts.running = queues.depth(t.name), running_of.get(t.name, 0)
            ts.rate_rps, ts.mean_input, ts.mean_output = r.rate(now), r.mean_input, r.mean_output
            a = self.attainment[t.name]
            ts.violation_rate, ts.recent_requests = a.rate, a.requests
        snap.now = now
        snap.leases = LeaseTable(leases)
        return snap

    def _changed(self, views: dict[str, DeviceView], rows: dict[str, dict[str, str]], assigned: dict,
                 shares: dict[str, float]) -> set[str] | None:
        """The devices whose inputs may have changed since the last build, or None for every device (the first
        build, a plain placements dict, or a views mapping that is not the one seen last or changed size)."""
        versions = self.core.queues.versions
        changed_assigned = getattr(assigned, "changed", None)
        if changed_assigned is None or views is not self._views or len(views) != self._n_views:
            self._views, self._n_views = views, len(views)
            for v in views.values():  # one builder per scheduler: the first one to see a view hears of it
                if v.__dict__.get("_sink") is None:
                    object.__setattr__(v, "_sink", self._dirty_views)
            self._dirty_views.clear()
            if changed_assigned is not None:
                changed_assigned.clear()
            self._rows_obj, self._rows_seen = rows, dict(rows)
            self._qver, self._shares = dict(versions), shares
            self._routing_changed = set()
            return None
        out = set(self._dirty_views)
        self._dirty_views.clear()
        out |= changed_assigned
        changed_assigned.clear()
        if rows is not self._rows_obj:  # a device refresh: rows whose content changed are new objects
            seen = self._rows_seen
            out.update(did for did, row in rows.items() if seen.get(did) is not row)
            out.update(seen.keys() - rows.keys())
            self._rows_obj, self._rows_seen = rows, dict(rows)
        if versions != self._qver:
            for t, ver in versions.items():
                if self._qver.get(t) != ver:
                    out.update(self._homes.get(t, ()))
            self._qver = dict(versions)
        for t, _ in self._routing_changed:
            out.update(self._homes.get(t, ()))
        self._routing_changed = set()
        old = self._shares
        if shares != old:
            out.update(g for g in shares.keys() | old.keys() if shares.get(g, 0) != old.get(g, 0))
        self._shares = shares
        return {did for did in out if did in self._dev}

    def _first(self, now: float) -> ClusterSnapshot:
        """The snapshot's skeleton: every device and tenant with nothing known yet (build fills them in)."""
        devices = {}
        for d in self.cluster.devices:
            home = self.home_of.get(d.id)
            devices[d.id] = DeviceState(id=d.id, kind=d.kind, host=d.host, capacity_bytes=d.memory_bytes,
                                        headroom_bytes=0, home_tenant=home, tenants=[home] if home else [])
        tenants = {t.name: TenantState(t.name, t.model.config, t.sla, list(t.home_devices))
                   for t in self.tenants.tenants}
        return ClusterSnapshot(now=now, devices=devices, tenants=tenants, intra_host_link=self.cluster.intra_host_link,
                               inter_host_link=self.cluster.inter_host_link, tracked=True)


class LeaseManager:
    """Commits the policy's lease actions: stage weights + lease reservation on the guest (atomic GMG commits),
    then tells the driver and the guest worker; revokes and expires leases the same way."""

    def __init__(self, prefix: str, store: GMGStore, producer: StreamProducer, tenants: TenantsConfig,
                 activation_bytes: int = 4 * 2**20) -> None:
        self.p, self.store, self.producer, self.tenants = prefix, store, producer, tenants
        self.leases_store = LeaseStore(store)
        self.active: dict[str, LeaseState] = {}
        self.granted = self.revoked = self.expired = self.refused = self.extended = 0
        self.activation_bytes = activation_bytes
        self._resident: set[tuple[str, str, str]] = set()  # (guest, tenant, segment) this scheduler saw staged
        self._last_used: dict[str, dict[str, float]] = {}  # guest -> "tenant|segment" -> last lease on it (LRU)
        self.evicted = 0
        self._seg_bytes = {t.name: {s.name: s.weight_bytes for s in ModelGraph.from_config(t.model.config).segments}
                           for t in tenants.tenants}

    async def grant(self, g: GrantLease, now: float) -> LeaseState | None:
        st, msgs = await self._commit_grant(g, now)
        if msgs:
            await self.producer.add_many(msgs)
        return st

    async def _commit_grant(self, g: GrantLease, now: float) -> tuple[LeaseState | None, list]:
        """Stage the weights and commit the lease in the GMG; returns the lease and the two LeaseGranted messages
        still to send (none when refused)."""
        if tuple(g.segments) == ("*",):  # "sequences" mode: the whole model is staged on the guest
            missing = {"*": sum(self._seg_bytes[g.tenant].values())}
        else:
            missing = {s: self._seg_bytes[g.tenant][s] for s in g.segments}
        lid = uuid.uuid4().hex[:12]
        lease = Lease(lid, g.tenant, g.guest_device, tuple(g.segments), now, now + g.duration_s,
                      self.activation_bytes, home=g.home_device, share=g.share, mode=g.mode,
                      handback=getattr(g, "handback", False))
        # one commit stages what this scheduler has not seen resident there and commits the lease, evicting in
        # the same script the cached weights of ended leases (least recently leased first) it needs the memory of;
        # if its view was stale (evicted or staged by someone else meanwhile), one more after reading residency
        recency = self._last_used.get(g.guest_device, {})
        res = await self.leases_store.commit_making_room(
            lease, recency, stage={s: n for s, n in missing.items()
                                   if (g.guest_device, g.tenant, s) not in self._resident})
        if isinstance(res, Refused) and res.reason in ("already_resident", "not_resident"):
            here = await self.leases_store.resident(g.guest_device, g.tenant, missing)
            self._resident -= {(g.guest_device, g.tenant, s) for s in missing}
            self._resident |= {(g.guest_device, g.tenant, s) for s in here}
            res = await self.leases_store.commit_making_room(
                lease, recency, stage={s: n for s, n in missing.items() if s not in here})
        if isinstance(res, Refused):
            self.refused += 1
            log.info("lease_refused", tenant=g.tenant, guest=g.guest_device, reason=res.reason, detail=res.detail)
            return None, []
        self.note_evicted(res.evicted)
        self._resident |= {(g.guest_device, g.tenant, s) for s in missing}
        self._last_used.setdefault(g.guest_device, {}).update({f"{g.tenant}|{s}": now for s in missing})
        st = LeaseState(lid, g.tenant, g.home_device, g.guest_device, tuple(g.segments), now, now + g.duration_s,
                        g.memory_bytes + self.activation_bytes, g.share, mode=getattr(g, "mode", "segments"),
                        state="active", handback=getattr(g, "handback", False))
        self.active[lid] = st
        self.granted += 1
        msg = dict(lease_id=lid, tenant=g.tenant, home_device=g.home_device, guest_device=g.guest_device,
                   segments=list(g.segments), start_ts=now, end_ts=now + g.duration_s, share=g.share,
                   memory_bytes=st.memory_bytes, mode=st.mode, handback=st.handback)
        log.info("lease_granted", tenant=g.tenant, lease_id=lid, home=g.home_device, guest=g.guest_device,
                 segments=",".join(g.segments), share=round(g.share, 2), mode=st.mode)
        return st, [(worker_stream(self.p, d), LeaseGranted(msg_id=uuid.uuid4().hex, **msg))
                    for d in (g.guest_device, g.home_device)]

    def room(self, device: str) -> Room:
        """What a commit on ``device`` may evict to fit (a request's KV reservation): weights staged there that no
        active lease pins, least recently leased first as this scheduler saw them leased, never the device's home
        tenant's (the GMG's script picks them, :class:`shared.gmg.store.Room`). The simulator admits the same way
        (``DeviceMemory.make_room``): cached weights are reclaimable memory, not a reason to refuse."""
        return Room(device, (), self._last_used.get(device, {}))

    def note_evicted(self, evicted) -> None:
        """Account the staged weights a commit evicted to make room: ``(device, tenant, segment, bytes)`` each."""
        for device, tenant, seg, nbytes in evicted:
            self.evicted += 1
            self._resident.discard((device, tenant, seg))
            self._last_used.get(device, {}).pop(f"{tenant}|{seg}", None)
            log.info("staged_weights_evicted", device=device, tenant=tenant, segment=seg, bytes=nbytes,
                     by="scheduler")

    async def revoke(self, lease_id: str, reason: str, state: str = "revoked") -> bool:
        st = self.active.pop(lease_id, None)
        if st is None:
            return False
        now = time.time()
        self._last_used.setdefault(st.guest_device, {}).update({f"{st.tenant}|{s}": now for s in st.segments})
        await self.leases_store.close(lease_id, state, reason)
        msg = dict(lease_id=lease_id, tenant=st.tenant, home_device=st.home_device, guest_device=st.guest_device,
                   reason=reason)
        await self.producer.add_many([(worker_stream(self.p, st.home_device), LeaseRevoked(msg_id=uuid.uuid4().hex, **msg)),
                                      (worker_stream(self.p, st.guest_device), LeaseRevoked(msg_id=uuid.uuid4().hex, **msg))])
        if state == "expired":
            self.expired += 1
        else:
            self.revoked += 1
        log.info("lease_ended", lease_id=lease_id, tenant=st.tenant, state=state, reason=reason)
        return True

    async def expire(self, now: float) -> list[LeaseState]:
        ended = [st for st in self.active.values() if st.end_s <= now]
        for st in ended:
            await self.revoke(st.id, "window_ended", state="expired")
        return ended

    async def revoke_device(self, device: str, reason: str) -> None:
        for lid in [lid for lid, st in self.active.items() if device in (st.guest_device, st.home_device)]:
            await self.revoke(lid, reason)

    async def extend(self, lease_id: str, duration_s: float, now: float) -> bool:
        """Move an active lease's end; the GMG record and both workers (LeaseGranted re-sent, same id) follow."""
        st = self.active.get(lease_id)
        if st is None:
            return False
        st.end_s = now + duration_s
        k = self.store.keys
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.hset(k.lease(lease_id), "end_ts", f"{st.end_s:.6f}")
        pipe.zadd(k.leases(st.guest_device), {lease_id: st.end_s})
        pipe.incr(k.epoch)
        await pipe.execute()
        msg = dict(lease_id=lease_id, tenant=st.tenant, home_device=st.home_device, guest_device=st.guest_device,
                   segments=list(st.segments), start_ts=st.start_s, end_ts=st.end_s, share=st.share,
                   memory_bytes=st.memory_bytes, mode=st.mode, handback=st.handback)
        await self.producer.add_many([(worker_stream(self.p, d), LeaseGranted(msg_id=uuid.uuid4().hex, **msg))
                                      for d in (st.guest_device, st.home_device)])
        self.extended += 1
        return True

    async def apply(self, actions: list, now: float) -> None:
        """Revocations and extensions first, in order (a revocation frees memory a grant may need); then every
        grant's GMG commits concurrently (each is atomic on its own; the GMG refuses what no longer fits) and
        all their LeaseGranted messages in one round trip."""
        for a in actions:
            if isinstance(a, RevokeLease):
                await self.revoke(a.lease_id, a.reason or "policy")
            elif isinstance(a, ExtendLease):
                await self.extend(a.lease_id, a.duration_s, now)
        grants = [a for a in actions if isinstance(a, GrantLease)]
        if len(grants) == 1:
            await self.grant(grants[0], now)
        elif grants:
            done = await asyncio.gather(*(self._commit_grant(g, now) for g in grants), return_exceptions=True)
            msgs = [m for d in done if not isinstance(d, BaseException) for m in d[1]]
            if msgs:  # the committed ones are announced even if another grant hit a Redis error
                await self.producer.add_many(msgs)
            for d in done:
                if isinstance(d, BaseException):
                    raise d


def wall_now() -> float:
    return time.time()
