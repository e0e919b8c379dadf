"""Applying policy actions inside the simulator: lease grant (staging over a link) / activation / end / revoke,
and container reassignment (drain, reload, serve the new tenant)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

from shared.costmodel import cost_for, transfer_time
from shared.model.graph import parse_segment
from shared.policies.actions import ExtendLease, GrantLease, Reassign, RevokeLease, Trigger
from shared.policies.snapshot import LeaseState
from shared.sim.replica import SimReplica
from shared.sim.sim_lease import ACTIVE, DRAINING, ENDED, REVOKED, STAGING, SimLease
from shared.costmodel.offload import OffloadPart
from shared.handback import HANDBACK_FILL, best_fit, step_with

if TYPE_CHECKING:
    from shared.sim.device import SimDevice
    from shared.sim.replica import SimReplica
    from shared.sim.simulator import Simulator

STAGE_DONE, LEASE_END, RELOAD_DONE, KV_MOVED = 2, 3, 4, 5


def _step_with(e: "SimReplica", r) -> float:
    """``e``'s predicted step once ``r`` joins its batch (every sequence it runs or is taking in), with the chunk of
    its queued prompt tokens each step carries."""
    joining = sum(q.input + q.generated for _, q in e.joining)
    return step_with(e.cost, len(e.decoding) + len(e.prefilling) + len(e.joining), e.decode_kv + joining,
                     r.input, e.queued_prefill, e.cfg.max_batched_tokens) * e.slowdown


class LeaseBook:
    """Lease and reassignment bookkeeping for one simulation run."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = sim
        self.leases: dict[str, SimLease] = {}
        self.link_free: dict[tuple[str, str], float] = {}
        self.link_busy_s: dict[str, float] = {}
        self.link_bytes: dict[str, float] = {}
        self.stats = {"granted": 0, "refused": 0, "revoked": 0, "ended": 0, "staged_bytes": 0, "reassigned": 0,
                      "refused_reasons": {}}
        self.pending_reassign: dict[str, tuple[str, float]] = {}
        self.finished: list[SimLease] = []

    # ---------------------------------------------------------------- dispatch
    def apply(self, actions: Iterable) -> None:
        for a in actions or ():
            if isinstance(a, GrantLease):
                self.grant(a)
            elif isinstance(a, RevokeLease):
                lease = self.leases.get(a.lease_id)
                if lease is not None:
                    self.end(lease, revoked=True)
            elif isinstance(a, ExtendLease):
                lease = self.leases.get(a.lease_id)
                if lease is not None:
                    lease.end = self.sim.now + a.duration_s
                    self.sim.snapshot.leases[lease.lid].end_s = lease.end
                    self.sim.push(lease.end, LEASE_END, lease)
            elif isinstance(a, Reassign):
                self.reassign(a)
            else:
                raise TypeError(f"unknown action {a!r}")

    def on_event(self, kind: int, obj, ver: int) -> None:
        if kind == STAGE_DONE:
            if obj.state == STAGING:
                self.activate(obj)
        elif kind == LEASE_END:
            if obj.state in (STAGING, ACTIVE) and self.sim.now >= obj.end - 1e-12:
                self.end(obj, revoked=False)
        elif kind == RELOAD_DONE:
            self._reload_done(obj)
        elif kind == KV_MOVED:
            self._kv_moved(*obj)

    def _transfer(self, src: "SimDevice", dst: "SimDevice", link_kind: str, nbytes: float) -> float:
        """Move ``nbytes`` from ``src`` to ``dst`` after what that link already carries; returns when it is there."""
        start = max(self.sim.now, self.link_free.get((src.id, dst.id), self.sim.now))
        done = start + transfer_time(src.profile, link_kind, nbytes)
        self.link_free[(src.id, dst.id)] = done
        self.link_busy_s[link_kind] = self.link_busy_s.get(link_kind, 0.0) + (done - start)
        self.link_bytes[link_kind] = self.link_bytes.get(link_kind, 0.0) + nbytes
        return done

    def _refuse(self, reason: str) -> None:
        self.stats["refused"] += 1
        r = self.stats["refused_reasons"]
        r[reason] = r.get(reason, 0) + 1

    # ---------------------------------------------------------------- leases
    def grant(self, a: GrantLease) -> SimLease | None:
        """Stage the missing segment weights on the guest (memory reserved now, transfer over the link) and
        activate the lease when the transfer is done; refuse cleanly when it does not fit."""
        sim, now = self.sim, self.sim.now
        home, guest = sim.devices.get(a.home_device), sim.devices.get(a.guest_device)
        if home is None or guest is None or home is guest:
            return self._refuse("devices") or None
        eng = sim.engine_of(home, a.tenant)
        if eng is None or not a.segments:
            return self._refuse("no_engine") or None
        if a.share <= 0 or guest.committed_share() + a.share > 0.95:
            return self._refuse("share") or None
        gcost = cost_for(sim.model_of(a.tenant), guest.kind)
        mem = guest.mem
        m = sim.cfg.micro_batches
        if a.mode == "sequences":
            if tuple(a.segments) != ("*",) or any(x.mode == "sequences" and x.engine.tenant == a.tenant
                                                   for x in guest.hosted):
                return self._refuse("segments") or None
            seg_bytes, act = gcost.weight_bytes, 0
        elif a.mode == "segments":
            taken = {s for lease in self.leases.values() if lease.engine is eng for s in lease.segments}
            for s in a.segments:
                kind, _ = parse_segment(s)
                if kind != "mlp" or s in taken:
                    return self._refuse("segments") or None
            seg_bytes = gcost.mlp_weight_bytes
            act = 2 * m * -(-sim.cfg.max_batched_tokens // m) * gcost.hidden_bytes_per_token
        else:
            return self._refuse("mode") or None
        new = [s for s in a.segments if (a.tenant, s) not in mem.staged]
        new_bytes = len(new) * seg_bytes
        reused = [s for s in a.segments if (a.tenant, s) in mem.staged]
        for s in reused:  # pin first so that making room cannot evict what this lease reuses
            mem.stage(a.tenant, s, seg_bytes, now)
        if not mem.make_room(new_bytes + act, now):
            for s in reused:
                mem.unpin(a.tenant, s, now)
            return self._refuse("memory") or None
        for s in new:
            mem.stage(a.tenant, s, seg_bytes, now)
        mem.alloc("activations", act, now)
        link_kind = sim.snapshot.link_kind(home.id, guest.id)
        link = home.profile.link(link_kind)
        done = self._transfer(home, guest, link_kind, new_bytes) if new_bytes else now
        lid = sim.next_id("L")
        lease = SimLease(lid, eng, guest, tuple(a.segments), OffloadPart(guest.id, len(a.segments), a.share, link,
                                                                      gcost, lid),
                         a.share, now, now + a.duration_s, act)
        lease.staged_new_bytes = new_bytes
        lease.mode = a.mode
        lease.handback = getattr(a, "handback", False)
        self.leases[lid] = lease
        guest.hosted.append(lease)
        guest.state.guest_share = guest.committed_share()
        self.stats["granted"] += 1
        self.stats["staged_bytes"] += new_bytes
        sim.snapshot.leases[lid] = LeaseState(lid, a.tenant, home.id, guest.id, tuple(a.segments), now, lease.end,
                                              new_bytes + act, a.share, mode=a.mode, handback=lease.handback)
        sim.push(lease.end, LEASE_END, lease)
        if done <= now:
            self.activate(lease)
        else:
            sim.push(done, STAGE_DONE, lease)
        self._mirror_memory(guest)
        return lease

    def activate(self, lease: SimLease) -> None:
        sim = self.sim
        lease.state = ACTIVE
        lease.active_from = sim.now
        guest = lease.guest_dev
        if lease.mode == "sequences":
            lane = lease.lane = guest.make_lane(lease)
            src = lease.engine
            lane.engines.append(SimReplica(sim.next_id("e"), src.tenant, lane, src.cost if src.device.kind == guest.kind
                                       else cost_for(sim.model_of(src.tenant), guest.kind), sim.cfg,
                                       sim._on_first_token, sim._on_finish, 0))
            lane.engines[0].tpot_s, lane.engines[0].ttft_s = src.tpot_s, src.ttft_s
            if lease.handback:
                lane.engines[0].handback = lambda r, now, lease=lease: self._handback(lease, r, now)
        else:
            lease.engine.offload.append(lease)
        sim.snapshot.leases[lease.lid].state = ACTIVE
        guest.update_slowdown(sim.now)
        sim.wake(lease.engine.device)
        sim.refresh(guest)

    def end(self, lease: SimLease, revoked: bool) -> None:
        """Lease over: the home runs the segments itself from its next iteration (segments mode), or the guest
        stops taking the tenant's sequences and finishes those it holds (sequences mode); staged weights stay
        cached on the guest until it needs the memory."""
        sim = self.sim
        if lease.state == DRAINING:
            return
        self.stats["revoked" if revoked else "ended"] += 1
        if lease.mode == "sequences" and lease.state == ACTIVE and lease.lane is not None:
            lane = lease.lane
            lease.state = DRAINING
            if revoked:  # the guest's own tenant needs its device back: the leftovers get a small share only
                lease.share = min(lease.share, 0.2)
            moved = []
            for e in lane.engines:
                e.draining = True
                while e.waiting:
                    r = e.waiting.popleft()
                    e.queued_prefill -= r.input
                    moved.append(r)
            sim.snapshot.leases[lease.lid].state = DRAINING
            lease.guest_dev.update_slowdown(sim.now)
            sim.refresh(lease.guest_dev)
            self._reroute(moved)
            if all(e.outstanding == 0 for e in lane.engines):
                self.lane_drained(lane)
            else:
                sim.wake(lease.guest_dev)
            self._after_end(lease, revoked)
            return
        self._finalize(lease, revoked)
        self._after_end(lease, revoked)

    def _handback(self, lease: SimLease, r, now: float) -> bool:
        """A lane finished ``r``'s prompt: its KV moves over the link to the lease's home device, which decodes it
        in its own batch from its first step after the transfer (a lease granted with ``handback``). Past the fill
        bound of ``shared/handback.py`` another device of the container within it takes it (:meth:`_fill_target`).
        Otherwise, when that engine is draining or the KV does not fit there, another device of the tenant's
        container takes it: of those whose engine is not draining, the one with the most free memory, if the KV
        fits. Cached staged weights no lease pins make way on the device that takes it, as at admission (the
        worker's hand-off evicts them in the GMG the same way). False (the lane keeps it) when none can."""
        sim, guest = self.sim, lease.guest_dev
        home = lease.engine
        need = home.kv_need(r)
        fit = self._fill_target(lease, r, need)
        if fit is not None and _reserve_kv(fit, need, now):
            home = fit
        elif home.draining or not _reserve_kv(home, need, now):
            home = self._other_home(lease, need)
            if home is None or not _reserve_kv(home, need, now):
                return False
        hdev = home.device
        done = self._transfer(guest, hdev, sim.snapshot.link_kind(guest.id, hdev.id),
                              (r.input + 1) * home.cost.kv_bytes_per_token)
        home.joining.append((math.inf, r))  # counted as the home's from now; joins its batch once the KV is there
        r.engine = home
        self.stats["handed_back"] = self.stats.get("handed_back", 0) + 1
        sim.push(done, KV_MOVED, (lease, r, need))
        return True

    def _fill_target(self, lease: SimLease, r, need: int) -> "SimReplica | None":
        """Another device of the container for ``r`` when the lease's home is draining or its predicted step with
        ``r`` is past :data:`~shared.handback.HANDBACK_FILL` × ``r``'s TPOT target: of those with room for the
        KV, the one whose step is the longest still within it (:func:`~shared.handback.best_fit`); None when the
        home is within it or no other device is."""
        bound = HANDBACK_FILL * self.sim.tpot_target(r)
        home = lease.engine
        if not home.draining and _step_with(home, r) <= bound:
            return None
        return best_fit(((e, _step_with(e, r)) for e, _ in self._container_engines(lease, need)), bound)

    def _container_engines(self, lease: SimLease, need: int):
        """``(engine, free bytes)`` of ``lease``'s tenant on each other device of its container where ``need``
        bytes of KV fit and the engine is not draining."""
        sim = self.sim
        for did in sim.snapshot.tenants[lease.tenant].home_devices:
            d = sim.devices.get(did)
            if d is None or d is lease.engine.device:
                continue
            free = d.mem.limit - d.mem.used
            if free < need:
                continue
            for e in d.engines:
                if e.tenant == lease.tenant and not e.draining:
                    yield e, free
                    break

    def _other_home(self, lease: SimLease, need: int):
        """The engine of ``lease``'s tenant on another device of its container with the most free memory, if
        ``need`` bytes of KV fit there (what a worker's hand-off does when the lease's home has no room)."""
        best, room = None, need - 1
        for e, free in self._container_engines(lease, need):
            if free > room:
                best, room = e, free
        return best

    def _kv_moved(self, lease: SimLease, r, need: int) -> None:
        sim, home = self.sim, r.engine  # the lease's home, or the device of its container that took the sequence
        lease.guest_dev.mem.release("kv", r.kv_bytes, sim.now)
        r.kv_bytes = need
        home.joining = [(sim.now if q is r else at, q) for at, q in home.joining]
        hdev = home.device
        if hdev.cur is None:
            hdev.start(sim.now)
        else:
            hdev.interrupt(sim.now)
        sim.refresh(hdev)
        sim.refresh(lease.guest_dev)

    def lane_drained(self, lane: "SimDevice") -> None:
        """A draining guest lane finished its last sequence: release it."""
        lease = lane.lease
        guest = lane.parent
        if lease is None or guest is None:
            return
        if lane in guest.lanes:
            guest.lanes.remove(lane)
        self._finalize(lease, lease.state == REVOKED)

    def _finalize(self, lease: SimLease, revoked: bool) -> None:
        sim, now = self.sim, self.sim.now
        was_running = lease.state in (ACTIVE, DRAINING)
        lease.state = REVOKED if revoked else ENDED
        if lease in lease.engine.offload:
            lease.engine.offload.remove(lease)
        guest = lease.guest_dev
        if lease in guest.hosted:
            guest.hosted.remove(lease)
        for s in lease.segments:
            guest.mem.unpin(lease.tenant, s, now)
        if lease.act_bytes:
            guest.mem.release("activations", lease.act_bytes, now)
        self.leases.pop(lease.lid, None)
        self.finished.append(lease)
        sim.snapshot.leases.pop(lease.lid, None)
        guest.state.guest_share = guest.committed_share()
        if was_running:
            guest.update_slowdown(now)
            sim.wake(lease.engine.device)
        sim.wake(guest)
        self._mirror_memory(guest)

    def _after_end(self, lease: SimLease, revoked: bool) -> None:
        sim = self.sim
        kind = "lease_revoked" if revoked else "lease_end"
        self.apply(sim.policy.decide(Trigger(kind, lease.tenant, lease.guest_dev.id, lease.lid), sim.snapshot,
                                     sim.whatif))

    def _reroute(self, moved: list) -> None:
        sim = self.sim
        for r in moved:
            did = sim.policy.route(r.tenant, r.input, r.output, sim.snapshot)
            target = sim.devices.get(did) if did else None
            eng = sim.engine_of(target, r.tenant) if target else None
            if eng is None:
                sim._reject(r, sim.snapshot.tenants[r.tenant])
                continue
            eng.enqueue(r)
            sim.wake(target)

    def _mirror_memory(self, dev: "SimDevice") -> None:
        s, m = dev.state, dev.mem
        s.used_bytes, s.staged_bytes, s.evictable_bytes = m.used, m.by_kind["staged"], m.evictable()
        s.resident = {k: e.nbytes for k, e in m.staged.items()}
        self.sim.snapshot.touch(s)

    # ---------------------------------------------------------------- reassignment (container-realloc)
    def reassign(self, a: Reassign) -> None:
        """Drain ``a.device`` (waiting requests are routed elsewhere), then reload weights for the new tenant."""
        sim = self.sim
        dev = sim.devices.get(a.device)
        if dev is None or dev.state.draining or a.device in self.pending_reassign:
            return self._refuse("reassign")
        self.stats["reassigned"] += 1
        self.pending_reassign[dev.id] = (a.tenant, a.reload_s)
        dev.state.draining = True
        moved = []
        for e in dev.engines:
            e.draining = True
            while e.waiting:
                r = e.waiting.popleft()
                e.queued_prefill -= r.input
                moved.append(r)
        sim.refresh(dev)
        self._reroute(moved)
        if all(e.outstanding == 0 for e in dev.engines):
            self.drained(dev, None)

    def drained(self, dev: "SimDevice", eng: "SimReplica | None") -> None:
        if dev.id not in self.pending_reassign or any(e.outstanding for e in dev.engines if e.draining):
            return
        for e in [e for e in dev.engines if e.draining]:
            self.sim.remove_engine(dev, e)
        tenant, reload_s = self.pending_reassign[dev.id]
        self.sim.push(self.sim.now + reload_s, RELOAD_DONE, dev)

    def _reload_done(self, dev: "SimDevice") -> None:
        tenant, _ = self.pending_reassign.pop(dev.id)
        self.sim.add_engine(dev, tenant)
        dev.state.home_tenant = tenant
        dev.state.draining = False
        self.sim.refresh(dev)


def _reserve_kv(engine, need: int, now: float) -> bool:
    """Reserve a handed-back sequence's KV on ``engine``'s device, evicting cached staged weights that no lease
    pins when they are what stands in the way (``SimReplica.admit`` does the same)."""
    mem = engine.device.mem
    return mem.try_alloc("kv", need, now) or (mem.make_room(need, now) and mem.try_alloc("kv", need, now))
