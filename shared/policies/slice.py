"""``slice``: containers plus leases of predicted idle slices on other tenants' devices, at segment granularity.

Incremental: it looks at a tenant only when something changes for it (a request arrives and its predicted SLA
slack is low, a periodic forecast tick, a lease ends or is revoked). For a tenant that is behind it builds a
bounded candidate set — guest devices ranked by predicted idleness, free memory and link bandwidth; for each, the
MLP segments to move (staged ones first; as many layers as balance home and guest time) and the share of the
guest's time its own tenant can spare — asks the what-if for all of them at once and commits the best one that
helps enough (plus up to ``max_commits`` − 1 more "sequences" leases on other guests when a burst needs them).
It never grants a lease whose predicted worst case pushes the guest's own tenant past (a margin of) its SLA; at
run time the guest's own work comes first, and leases are revoked when the guest's tenant needs the memory
they pin.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any

from shared.costmodel import cost_for
from shared.policies.actions import Action, ExtendLease, GrantLease, Placement, RevokeLease, Trigger
from shared.policies.base import POLICIES, OfferedLoad, Policy, PolicyConfig, least_loaded
from shared.policies.container import container_placement
from shared.policies.guest_index import Indexes, rank_all
from shared.policies.snapshot import ClusterSnapshot, DeviceState, TenantState


# A share bound by the guest's SLA is offered a hair inside it: the what-if checks the same latency with ``>``, and
# a share exactly on the bound can come back a rounding error over it (87.20000000000002 > 87.2 ms refused the best
# guests of bursts).
SHARE_EPS = 1e-6
PREFILL_CHUNK = 2048  # prompt tokens per iteration the routing prices a device's prefill at


@dataclass(frozen=True)
class SliceConfig(PolicyConfig):
    """Parameters (docs/policies.md)."""

    resize: bool = False  # True: containers sized from average offered work, as ``container-avgwork``
    behind_fraction: float = 0.5  # seek a lease when predicted TTFT or TPOT exceeds this fraction of the target
    tenant_behind_fraction: float = 0.5  # ... on at least this fraction of the tenant's container
    tenant_behind_devices: int = 2  # >0: ... or on this many of its devices, if fewer
    max_candidates: int = 16  # guest devices asked about per decision ("sequences" candidates)
    max_segment_candidates: int = 8  # of those, the first this many also get a "segments" candidate
    lease_s: float = 2.0
    sequence_lease_s: float = 1.0  # "sequences" leases (whole iterations on the guest), extended while useful
    sequences: bool = True  # also consider the second mode
    segments: bool = True  # consider "segments" leases (MLP offload); off where they do not pay (CPU meshes)
    max_sequence_leases: int = 8  # per home device
    lane_handback: bool = True  # sequences leases hand each prefilled sequence home (docs/guest-execution.md)
    share_max: float = 0.6  # most of a busy guest's time one lease may take
    min_share: float = 0.1
    min_gain: float = 0.08  # predicted iteration-time saving needed to commit
    lane_wait_fraction: float = 0.0  # >0: while the home has no prompt queued and TPOT slack, a shorter lane wait
    #   takes a prompt only once the home's wait is past this × the prompt's TTFT target
    home_step_fraction: float = 0.4  # ... TPOT slack: the home's decode step alone within this × the TPOT target
    lane_tpot_fraction: float = 0.8  # >0: a home whose decode step is past this × TPOT target sends prompts to lanes
    max_leases: int = 3  # leases one home device may hold at once
    guest_margin: float = 0.8  # guest tenant's predicted latency must stay under margin × SLA
    guard_rate: float = 0.05  # >0: a device whose tenant missed its SLA on more than this share of its recent
    guard_ratio: float = 1.2  #   requests, and on more than guard_ratio × the borrower's share, lends it nothing new
    guard_min_requests: float = 50.0  #   (over at least this many recent requests; shared/policies/attainment.py)
    tick_s: float = 0.2
    min_seek_interval_s: float = 0.05
    max_commits: int = 3  # leases committed per decision (on distinct guests; one segments lease at most)
    horizon_s: float = 1.0


@POLICIES.register("slice")
class SlicePolicy(Policy):
    """Containers + segment leases on idle slices, checked by the what-if."""

    config_cls = SliceConfig
    wants_arrival = True
    check_index = False  # tests set it: every indexed candidate set is checked against a full scan

    def __init__(self, config: SliceConfig | None = None) -> None:
        super().__init__(config)
        self.tick_s = self.config.tick_s  # type: ignore[attr-defined]
        self.devices_of: dict[str, list[str]] = {}
        self.decisions = 0
        self.candidates_evaluated = 0
        self._prefill_cost: dict[tuple[int, str], float] = {}
        self._last_seek: dict[str, float] = {}
        self._extra: list[GrantLease] = []
        self._closed: set[str] = set()  # "sequences" leases whose lane is too slow for new requests now
        self._iter_of: dict[str, tuple] = {}  # device -> (what its own iteration was computed from..., cost, it, p)

    @property
    def cfg(self) -> SliceConfig:
        return self.config  # type: ignore[return-value]

    def initial_placement(self, snapshot: ClusterSnapshot, offered: dict[str, OfferedLoad]) -> Placement:
        self.devices_of = container_placement(snapshot, offered, self.cfg.resize)
        return Placement({d: (t,) for t, ds in self.devices_of.items() for d in ds})

    def route(self, tenant: str, input_tokens: int, output_tokens: int, snapshot: ClusterSnapshot) -> str | None:
        """Least-loaded device of the tenant's container, or a guest holding a "sequences" lease of it when the
        predicted wait for the first token is shorter there (its prompt queue over the share of the guest's time
        it gets now: everything the other leases leave while the guest's tenant is idle, its yield otherwise) and,
        with ``lane_wait_fraction`` > 0, no prompt queued at the home and its decode step alone within
        ``home_step_fraction`` × the TPOT target, the home's is past that fraction of the prompt's TTFT target."""
        devs = self.devices_of.get(tenant)
        if devs is None:
            devs = self.devices_of[tenant] = [d.id for d in snapshot.tenant_devices(tenant)]
        known, best = (self._indexes(snapshot).load.least_loaded(tenant, devs, self.config.max_queue_per_device)
                       if snapshot.tracked else (False, None))
        if not known:
            best = least_loaded(devs, snapshot, self.config.max_queue_per_device)
        elif self.check_index:
            want = least_loaded(devs, snapshot, self.config.max_queue_per_device)
            assert best == want, f"load index out of date: {best} != {want}"
        if best is None or not snapshot.leases:
            return best
        ten = snapshot.tenants[tenant]
        model = ten.model
        home = snapshot.devices[best]
        home_wait = self._home_wait(model, home, input_tokens)
        lane, lane_wait = None, float("inf")
        for lease in snapshot.leases_of(tenant):
            if lease.mode != "sequences" or lease.state != "active" or lease.id in self._closed:
                continue
            g = snapshot.devices[lease.guest_device]
            ge = g.guest_engines.get(tenant)
            if ge is None or not ge[2]:
                continue
            if g.busy or g.outstanding:
                total = sum(x.share for x in snapshot.leases_on(g.id)) or 1.0
                eff = g.guest_yield * lease.share / total
            else:
                eff = max(lease.share, 1.0 - (g.guest_share - lease.share))
            if eff <= 0.05:
                continue
            wait = (ge[1] + input_tokens) * self._per_token(model, g.kind) / eff
            if wait < lane_wait:
                lane, lane_wait = g.id, wait
        if lane is None:
            return best
        cfg = self.cfg

        def ttft() -> float:  # this prompt's own TTFT target (priced only where a rule needs it)
            return self.request_targets(ten)(input_tokens, output_tokens)[0]

        if lane_wait < home_wait and (cfg.lane_wait_fraction <= 0 or home.queued_prefill_tokens > 0
                                      or self._tpot_tight(ten, home, cfg.home_step_fraction)
                                      or home_wait > cfg.lane_wait_fraction * ttft()):
            # (a home with no prompt queued and TPOT slack keeps one well within its target: the lane's guest tenant
            # is spared its chunks, the prompt the lane's tail. A queued home's steps already carry chunks, and a
            # chunk in a batch near its TPOT target costs the whole batch: those send it on)
            return lane
        if cfg.lane_tpot_fraction > 0 and cfg.lane_handback and self._tpot_tight(ten, home, cfg.lane_tpot_fraction) \
                and lane_wait < ttft():
            return lane  # each step that prefilled it at home would slow the whole batch past its TPOT target
        return best

    def _tpot_tight(self, ten, home: DeviceState, fraction: float) -> bool:
        """The home's decode step alone is past ``fraction`` × its tenant's TPOT target."""
        if not home.running:
            return False
        step = cost_for(ten.model, home.kind).iteration_time(home.running, home.decode_kv_tokens)
        return step > fraction * ten.sla.tpot_ms / 1e3

    def _home_wait(self, model, home: DeviceState, input_tokens: int) -> float:
        """Predicted wait for the first token of a prompt queued on ``home``: its prompt queue in chunks of what the
        chunk budget leaves beside the decode batch, each chunk an iteration that also steps that batch. A busy
        tenant's chunks are full (the prompts behind this one fill them); with no batch, the queue at full speed.
        Without ``lane_handback`` the queue at full speed always: a prompt sent to a lane then also decodes there, at
        the guest's share, and pricing the home beside its batch sent more prompts to lanes than they could decode
        (docs/policies.md)."""
        queued = home.queued_prefill_tokens + input_tokens
        if not home.running or not self.cfg.lane_handback:
            return queued * self._per_token(model, home.kind)
        it, rows = cost_for(model, home.kind).chunk_iteration(home.running, home.decode_kv_tokens, PREFILL_CHUNK,
                                                              PREFILL_CHUNK)
        return -(-queued // max(1, rows)) * it

    def _per_token(self, model, kind: str) -> float:
        key = (id(model), kind)
        v = self._prefill_cost.get(key)
        if v is None:
            v = self._prefill_cost[key] = cost_for(model, kind).prefill_time(PREFILL_CHUNK) / PREFILL_CHUNK
        return v

    # ---------------------------------------------------------------- decisions
    def decide(self, trigger: Trigger, snapshot: ClusterSnapshot, whatif: Any = None) -> list[Action]:
        if whatif is None:
            return []
        with whatif.same_snapshot():  # one snapshot for the whole decision: per-device terms computed once
            return self._decide(trigger, snapshot, whatif)

    def _decide(self, trigger: Trigger, snapshot: ClusterSnapshot, whatif: Any) -> list[Action]:
        out: list[Action] = []
        if trigger.kind == "arrival" and trigger.device:
            d = snapshot.devices[trigger.device]
            out += self._protect(d, snapshot, whatif)
            if not out:
                g = self._seek(d, snapshot, whatif)
                if g:
                    out.append(g)
                    out += self._take_extra()
        elif trigger.kind == "tick":
            self._close_slow_lanes(snapshot, whatif)
            hosts = {lease.guest_device for lease in snapshot.leases.values()}
            for did in hosts:
                out += self._protect(snapshot.devices[did], snapshot, whatif)
            revoked = {a.lease_id for a in out if isinstance(a, RevokeLease)}
            out += self._extend(snapshot, whatif, revoked)
            busy = [d for d in snapshot.devices.values()
                    if d.home_tenant and (d.queued or d.queued_prefill_tokens) and not d.draining]
            busy.sort(key=lambda d: -self._urgency(d, snapshot, whatif))  # most urgent tenant first
            for d in busy[:4]:
                g = self._seek(d, snapshot, whatif)
                if g:
                    out.append(g)
                    out += self._take_extra()
                    break  # one search that commits per tick; the next tick sees its effect
        elif trigger.kind in ("lease_end", "lease_revoked") and trigger.tenant:
            for did in self.devices_of.get(trigger.tenant, []):
                g = self._seek(snapshot.devices[did], snapshot, whatif)
                if g:
                    out.append(g)
                    out += self._take_extra()  # every lease the search committed, as on the other triggers
                    break
        return out

    def _take_extra(self) -> list[Action]:
        extra, self._extra = self._extra, []
        return list(extra)

    def _extend(self, snapshot: ClusterSnapshot, whatif: Any, skip: set[str]) -> list[Action]:
        """Keep leases that are still useful (their tenant still behind, or sequences still queued on the guest)
        instead of letting them lapse and re-staging later."""
        out: list[Action] = []
        horizon = snapshot.now + 1.5 * self.cfg.tick_s
        for lease in snapshot.leases.values():
            if lease.id in skip or lease.state != "active" or lease.end_s > horizon:
                continue
            home = snapshot.devices[lease.home_device]
            g = snapshot.devices[lease.guest_device]
            if lease.id in self._closed:
                continue  # its lane is too slow now: let it drain and end
            busy_lane = lease.mode == "sequences" and (g.guest_engines.get(lease.tenant, (0, 0, True))[1] > 0)
            if busy_lane or (home.home_tenant == lease.tenant and self._behind(home, snapshot, whatif)):
                dur = self.cfg.sequence_lease_s if lease.mode == "sequences" else self.cfg.lease_s
                out.append(ExtendLease(lease.id, dur))
        return out

    def _close_slow_lanes(self, snapshot: ClusterSnapshot, whatif: Any) -> None:
        """Close to new requests (and stop extending) every "sequences" lease whose lane's predicted TPOT, with
        one more sequence, is past ``guest_margin`` × its tenant's target: the guest's own tenant has come back
        since the grant, and every token of a lane then waits for one of its iterations too. A lane that hands its
        sequences home is priced so only while its home lacks the memory to take them back (``WhatIf.decodes_home``):
        otherwise they decode in the home's batch and only their prompts wait for the guest."""
        closed = set()
        margin = self.cfg.guest_margin
        for lease in snapshot.leases.values():
            if lease.mode != "sequences" or lease.state != "active":
                continue
            t = snapshot.tenants[lease.tenant]
            if lease.handback and whatif.decodes_home(t, snapshot.devices[lease.home_device]):
                continue
            g = snapshot.devices[lease.guest_device]
            n = g.guest_engines.get(lease.tenant, (0, 0, True))[0] + 1
            if whatif.lane_tpot(snapshot, t, g, lease.share, n) > margin * t.sla.tpot_ms / 1e3:
                closed.add(lease.id)
        for lease in snapshot.leases.values():
            if lease.mode == "sequences" and self._guarded(snapshot.devices[lease.guest_device],
                                                            snapshot.tenants[lease.tenant], snapshot):
                closed.add(lease.id)
        self._closed = closed

    def _guarded(self, g: DeviceState, borrower: TenantState, snapshot: ClusterSnapshot) -> bool:
        """``g``'s own tenant has missed its SLA on more than ``guard_rate`` of its recent requests (over at least
        ``guard_min_requests``) and on more than ``guard_ratio`` × the share ``borrower`` has missed: ``g`` then
        lends ``borrower`` no new time, and ``borrower``'s lane there takes no new prompts, so that the tenants'
        violations even out instead of the lender's piling up (``shared/policies/attainment.py``)."""
        cfg = self.cfg
        if cfg.guard_rate <= 0 or g.home_tenant is None or g.home_tenant == borrower.name:
            return False
        own = snapshot.tenants[g.home_tenant]
        return own.recent_requests >= cfg.guard_min_requests and own.violation_rate > cfg.guard_rate \
            and own.violation_rate > cfg.guard_ratio * borrower.violation_rate

    def _own_latency(self, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any, share: float) -> tuple[float, float]:
        t = snapshot.tenants[d.home_tenant]  # type: ignore[index]
        return whatif.guest_latency(whatif.cost(t, d.kind), d, t, share)

    def _protect(self, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> list[Action]:
        """Revoke leases hosted on ``d`` (newest first) when its own tenant needs the memory they hold.

        Time needs no revocation: the device's own work always comes first (it yields nothing to guests while
        it has prompts to prefill, and only its TPOT slack otherwise), so guests can only slow it within its SLA.
        Memory does: staged weights pinned by leases and guest sequences' KV cannot be evicted, so when the KV
        its own queued requests need no longer fits, the newest leases go."""
        hosted = sorted((lease for lease in snapshot.leases_on(d.id) if lease.state != "draining"),
                        key=lambda x: -x.start_s)
        if not hosted or d.home_tenant is None:
            return []
        t = snapshot.tenants[d.home_tenant]
        need = whatif.kv_reserve(t, d)
        free = d.free_bytes + d.evictable_bytes
        out: list[Action] = []
        for lease in hosted:
            if free >= need:
                break
            out.append(RevokeLease(lease.id, "guest_tenant_needs_memory"))
            free += lease.memory_bytes
        return out

    def _urgency(self, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> float:
        """Predicted worst TTFT (or TPOT) of the tenant on ``d`` as a fraction of its target (the larger)."""
        t = snapshot.tenants[d.home_tenant]  # type: ignore[index]
        # the device's own iteration, remembered per device until its batch, queue, tenant or what-if changes
        c = self._iter_of.get(d.id)
        if c is None or c[0] is not t or c[1] is not whatif or c[2] is not t.model or c[3] != d.running or \
                c[4] != d.queued_prefill_tokens or c[5] != d.decode_kv_tokens or c[6] != d.kind:
            cost = whatif.cost(t, d.kind)
            it, _, p, _ = whatif.device_iteration(cost, d)
            c = self._iter_of[d.id] = (t, whatif, t.model, d.running, d.queued_prefill_tokens, d.decode_kv_tokens,
                                       d.kind, cost, it, p)
        cost, it, p = c[7], c[8], c[9]
        ttft, tpot = whatif.tenant_latency(cost, d, t, snapshot.now, it, p)
        return max(ttft / (t.sla.ttft_ms / 1e3), tpot / (t.sla.tpot_ms / 1e3) * self.cfg.behind_fraction / 0.9)

    def _behind(self, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> bool:
        """TTFT predicted past behind_fraction of its target, or TPOT past 90% of it."""
        bf = self.cfg.behind_fraction
        if not (d.running or d.queued_prefill_tokens) and bf >= 0:
            return False  # nothing to run: its next iteration takes no time, so its urgency is 0
        return self._urgency(d, snapshot, whatif) > bf

    def _tenant_behind(self, tenant: str, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> bool:
        """At least ``tenant_behind_fraction`` of the tenant's container (``d`` included) is behind, or at least
        ``tenant_behind_devices`` of its devices when that is fewer. A tenant with
        many devices absorbs a load spike on one of them by routing to the others; a lease for it would take guest
        time that a tenant with nowhere else to go needs (α = 2.1: the largest tenant, 16 devices and no
        violations, held 4× the lane time of the bursty one that had them all)."""
        cfg, devices = self.cfg, snapshot.devices
        devs = [g for g in (devices[did] for did in self.devices_of.get(tenant, ()) if did != d.id)
                if g.home_tenant == tenant and not g.draining]
        need = cfg.tenant_behind_fraction * (len(devs) + 1)
        if cfg.tenant_behind_devices > 0:  # a large container's spill-over is real before half of it is behind
            need = min(need, cfg.tenant_behind_devices)
        need -= 1.0  # d itself is behind
        if cfg.behind_fraction >= 0:  # a device with nothing to run is never behind (see _behind): skip those
            devs = [g for g in devs if g.running or g.queued_prefill_tokens]
        # the answer is whether at least `need` of them are behind: stop as soon as that is decided either way
        n, left = 0, len(devs)
        for g in devs:
            if n >= need or n + left < need:
                break
            n += self._behind(g, snapshot, whatif)
            left -= 1
        return n >= need

    def _seek(self, d: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> GrantLease | None:
        """Best lease for the tenant at home on ``d``, or None (at most one search per device per
        ``min_seek_interval_s``: a search that found nothing is not repeated before the state can have moved)."""
        cfg = self.cfg
        tenant = d.home_tenant
        if tenant is None or d.draining or not (d.running or d.queued):
            return None
        last = self._last_seek.get(d.id)
        if last is not None and snapshot.now - last < cfg.min_seek_interval_s:
            return None
        self._last_seek[d.id] = snapshot.now
        mine = [lease for lease in snapshot.leases_from(d.id) if lease.tenant == tenant and lease.state != "draining"]
        if not self._behind(d, snapshot, whatif) or not self._tenant_behind(tenant, d, snapshot, whatif):
            return None
        t = snapshot.tenants[tenant]
        layers = t.model.num_hidden_layers
        seg_leases = [lease for lease in mine if lease.mode == "segments"]
        taken = {s for lease in seg_leases for s in lease.segments}
        free_layers = [f"mlp[{i}]" for i in range(layers) if f"mlp[{i}]" not in taken]
        if not cfg.segments or len(seg_leases) >= cfg.max_leases:
            free_layers = []
        used_guests = {lease.guest_device for lease in mine}
        # never lease time on a device whose own tenant is behind itself, or further behind its SLA than this one
        cands = [g for g in self._guests(d, snapshot, used_guests)
                 if g.home_tenant is None or not (self._behind(g, snapshot, whatif) or self._guarded(g, t, snapshot))]
        hcost = whatif.cost(t, d.kind)
        shares: dict[str, float] = {}  # per guest, for both modes

        def share_of(g: DeviceState) -> float:
            v = shares.get(g.id)
            if v is None:
                v = shares[g.id] = self._share_for(g, snapshot, whatif)
            return v

        grants = []
        for g in (cands[: cfg.max_segment_candidates] if free_layers else []):
            share = share_of(g)
            if share < cfg.min_share:
                continue
            gcost = whatif.cost(t, g.kind)
            eff = share if (g.busy or g.outstanding) else 1.0 - g.guest_share
            n_layers = self._layers(hcost, gcost, d, g, snapshot, eff, len(free_layers), whatif)
            resident = [s for s in free_layers if (tenant, s) in g.resident]
            rest = [s for s in free_layers if (tenant, s) not in g.resident]
            segs = tuple((resident + rest)[:n_layers])
            mem = len([s for s in segs if (tenant, s) not in g.resident]) * gcost.mlp_weight_bytes
            grants.append(GrantLease(tenant, d.id, g.id, segs, cfg.lease_s, share, mem))
        n_seq = sum(1 for lease in mine if lease.mode == "sequences")  # lanes the home holds
        if cfg.sequences:
            # not on a device of the tenant's own container: routing already balances those, and a lane there
            # would only stage a second copy of the weights beside the first. Every candidate guest is asked
            # (the best are committed, up to the home's remaining lanes): a guest ranked low here (busy, on another
            # host) may still have the most time to spare — a large decoding batch with TPOT slack
            others = [g for g in cands if g.home_tenant != tenant]
            for g in (others if n_seq < cfg.max_sequence_leases else []):
                if any(x.tenant == tenant and x.mode == "sequences" for x in snapshot.leases_on(g.id)):
                    continue
                share = share_of(g)
                if share < cfg.min_share:
                    continue
                gcost = whatif.cost(t, g.kind)
                mem = 0 if (tenant, "*") in g.resident else gcost.weight_bytes
                grants.append(GrantLease(tenant, d.id, g.id, ("*",), cfg.sequence_lease_s, share, mem,
                                         mode="sequences", handback=cfg.lane_handback))
        if not grants:
            return None
        self.decisions += 1
        self.candidates_evaluated += len(grants)
        results = whatif.evaluate(snapshot, grants, cfg.horizon_s)
        ok = [r for r in results if r.ok and r.gain >= cfg.min_gain]
        if not ok:
            return None
        ok.sort(key=lambda r: (-r.gain, r.candidate.memory_bytes))
        picked, guests = [], set()
        lanes_left = cfg.max_sequence_leases - n_seq
        for r in ok:
            if r.candidate.guest_device in guests or (picked and r.candidate.mode == "segments"):
                continue
            if r.candidate.mode == "sequences":
                if lanes_left <= 0:
                    continue
                lanes_left -= 1
            c = r.candidate
            picked.append(dataclasses.replace(c, predicted_gain_s=r.home_iter_s - r.leased_iter_s))
            guests.add(c.guest_device)
            if len(picked) >= cfg.max_commits:
                break
        self._extra = picked[1:]
        return picked[0]

    def _layers(self, hcost, gcost, d: DeviceState, g: DeviceState, snapshot: ClusterSnapshot, eff: float,
                free: int, whatif: Any) -> int:
        """How many MLP layers to move: the count (of half, three quarters or all free layers) with the shortest
        predicted iteration for the home's current batch."""
        from shared.costmodel.offload import OffloadPart, offloaded_iteration_time
        from shared.costmodel import load_profile
        it, b, p, sampled = whatif.device_iteration(hcost, d)
        link = load_profile(d.kind).link(snapshot.link_kind(d.id, g.id))
        best, best_t = free, None
        mb = whatif.micro_batch_parts(hcost, d)
        for n in sorted({max(1, free // 2), max(1, 3 * free // 4), free}):
            t = offloaded_iteration_time(hcost, [OffloadPart(g.id, n, eff, link, gcost)], [eff], b,
                                         d.decode_kv_tokens, p, p * (p + 1) // 2, p, sampled,
                                         whatif.params.micro_batches, mb).total_s
            if best_t is None or t < best_t:
                best, best_t = n, t
        return best

    def _share_for(self, g: DeviceState, snapshot: ClusterSnapshot, whatif: Any) -> float:
        """Largest share of ``g``'s time whose worst case keeps its own tenant under guest_margin × SLA."""
        cfg = self.cfg
        room = min(cfg.share_max, 0.95 - g.guest_share)
        if g.home_tenant is None or room <= 0:
            return max(0.0, room)
        sla = snapshot.tenants[g.home_tenant].sla
        ttft0, tpot0 = self._own_latency(g, snapshot, whatif, g.guest_share)
        stretch0 = 1.0 - g.guest_share
        limit = min(1.0 - ttft0 * stretch0 / (cfg.guest_margin * sla.ttft_ms / 1e3),
                    1.0 - tpot0 * stretch0 / (cfg.guest_margin * sla.tpot_ms / 1e3))
        return max(0.0, min(room, limit - g.guest_share - SHARE_EPS))

    def _indexes(self, snapshot: ClusterSnapshot) -> Indexes:
        """The indexes this policy keeps on a tracked snapshot (built on first use)."""
        idx = snapshot.device_index
        if not isinstance(idx, Indexes):
            idx = snapshot.device_index = Indexes(snapshot.devices, self.devices_of)
        return idx

    def _guests(self, d: DeviceState, snapshot: ClusterSnapshot, exclude: set[str]) -> list[DeviceState]:
        """Bounded candidate set: idle first, then those with the tenant's weights staged (reuse: no staging),
        same host first, least loaded, most free memory (:func:`~shared.policies.guest_index.full_key`). On a
        tracked snapshot (the simulator's) from an index kept current as devices change; else by a full scan."""
        cap = 0.95 - self.cfg.min_share

        def eligible(g: DeviceState) -> bool:
            return not (g.id == d.id or g.id in exclude or g.draining or g.guest_share >= cap)

        if not snapshot.tracked:
            return rank_all(snapshot.devices.values(), d.home_tenant, d.host, self.cfg.max_candidates, eligible)
        out = self._indexes(snapshot).guests.rank(d.home_tenant, d.host, self.cfg.max_candidates, eligible)
        if self.check_index:  # tests: the index must give exactly what the full scan gives
            want = rank_all(snapshot.devices.values(), d.home_tenant, d.host, self.cfg.max_candidates, eligible)
            assert out == want, f"guest index out of date: {[g.id for g in out]} != {[g.id for g in want]}"
        return out

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["decisions"] = self.decisions
        d["candidates_evaluated"] = self.candidates_evaluated
        return d
