"""The discrete-event simulator: a workload replayed on a modelled cluster under one policy.

Pure: no asyncio, Redis, files or wall clock; randomness comes from the injected ``rng``; ids come from a per-run
counter; :meth:`Simulator.run` returns a :class:`~shared.sim.metrics.SimResult`. Events: request arrival, step end
per device (one iteration, or a run of identical decode iterations advanced in closed form), policy tick, lease
staging done (the weight transfer over its link), lease end/revoke, reassignment reload done.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Callable

from shared.config import ClusterConfig, TenantsConfig
from shared.costmodel import cost_for, load_profile
from shared.costmodel.sla import RequestTargets
from shared.policies.actions import Trigger
from shared.policies.attainment import Attainment, missed
from shared.policies.base import OfferedLoad, Policy
from shared.policies.rates import ArrivalStats
from shared.policies.sizing import offered_loads
from shared.policies.snapshot import ClusterSnapshot, DeviceState, TenantState
from shared.sim.device import SimDevice
from shared.sim.replica import SimReplica
from shared.sim.lease_book import LeaseBook
from shared.sim.metrics import SimResult, collect
from shared.sim.request import FAILED, REJECTED, SimRequest
from shared.workload import Workload

STEP, TICK, STAGE_DONE, LEASE_END, RELOAD_DONE, KV_MOVED = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class SimConfig:
    """Batching and run parameters shared by every policy."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 2048  # chunked-prefill token budget per iteration
    kv_block_tokens: int = 16
    micro_batches: int = 2  # pipelined micro-batches while segments run on guests
    closed_form: bool = True  # advance runs of identical decode iterations in one step
    drain_s: float = 300.0  # stop this long after the last arrival; unfinished requests count as failed
    timeline_points: int = 400
    guest_lanes: str = "exclusive"  # "exclusive": lane iterations take the whole device in turn; "fluid": older model
    # prompts admitted and chunked by first-token deadline, a step cut short of a chunk that would make a prompt it
    # completes late (shared/model/deadline.py; the workers' SLICESCHED_DEADLINE_CHUNKS)
    deadline_chunks: bool = False
    # while sequences decode, a step takes prefill tokens only while its predicted time stays within this many
    # seconds (shared/model/step_cap.py; the workers' SLICESCHED_STEP_CAP_S); 0: no cap
    step_cap_s: float = 0.0


class Simulator:
    """Replays a :class:`~shared.workload.Workload` on ``cluster`` with ``policy``."""

    def __init__(self, cluster: ClusterConfig, tenants: TenantsConfig, policy: Policy,
                 config: SimConfig | None = None, rng: random.Random | None = None) -> None:
        self.cluster, self.tenants_cfg, self.policy = cluster, tenants, policy
        self.cfg = config or SimConfig()
        if self.cfg.guest_lanes not in ("exclusive", "fluid"):
            raise ValueError(f"SimConfig.guest_lanes must be 'exclusive' or 'fluid', not {self.cfg.guest_lanes!r}")
        self.rng = rng or random.Random(0)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._ids = 0
        self.events = 0
        self.devices: dict[str, SimDevice] = {}
        for d in cluster.devices:
            self.devices[d.id] = SimDevice(d, load_profile(d.kind), cluster.headroom_fraction, self._schedule_step)
            self.devices[d.id].exclusive_lanes = self.cfg.guest_lanes == "exclusive"
        self.snapshot = ClusterSnapshot(
            now=0.0, intra_host_link=cluster.intra_host_link, inter_host_link=cluster.inter_host_link,
            devices={d.id: DeviceState(d.id, d.kind, d.host, d.memory_bytes,
                                       d.memory_bytes - self.devices[d.id].mem.limit) for d in cluster.devices},
            tenants={t.name: TenantState(t.name, t.model.config, t.sla, list(t.home_devices))
                     for t in tenants.tenants}, tracked=True)
        for dev in self.devices.values():
            dev.state = self.snapshot.devices[dev.id]
        self.requests: list[SimRequest] = []
        self.dynamic = False
        self.weights_free = False
        self.rejected = 0
        self._fresh: set[str] = set()
        self.leases = LeaseBook(self)
        self.whatif = None
        self._arrivals: dict[str, ArrivalStats] = {}
        self._attainment: dict[str, Attainment] = {}
        self._max_queue = {t.name: t.max_queue for t in tenants.tenants}
        self._budget: dict[str, float] | None = None  # early stop: violations a tenant may have (None: never stop)
        self._violations: dict[str, int] = {}
        self._targets: dict[str, RequestTargets] = {}
        self._lazy_targets: dict[str, RequestTargets] = {}  # priced on demand (tpot_target) when _targets is empty
        self.stopped_early = False

    def record_busy(self, bin_s: float) -> None:
        """Record every device's busy time in ``bin_s`` bins for :func:`shared.sim.anatomy.anatomy` (call before
        :meth:`run`)."""
        from shared.sim.anatomy import BusyBins
        for d in self.devices.values():
            d.bins = BusyBins(bin_s)

    # ---------------------------------------------------------------- ids and events
    def next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def push(self, t: float, kind: int, obj: object, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj, version))

    def _schedule_step(self, dev: SimDevice, t: float, version: int) -> None:
        self._seq += 1  # push(t, STEP, dev, version), inlined: one per device step
        heapq.heappush(self._heap, (t, self._seq, STEP, dev, version))

    # ---------------------------------------------------------------- engines
    def model_of(self, tenant: str):
        return self.snapshot.tenants[tenant].model

    def engine_of(self, dev: SimDevice, tenant: str) -> SimReplica | None:
        """The engine that takes new requests of ``tenant`` on ``dev`` (its own, or a guest lane's)."""
        for e in dev.engines:
            if e.tenant == tenant and not e.draining:
                return e
        for lane in dev.lanes:
            for e in lane.engines:
                if e.tenant == tenant and not e.draining:
                    return e
        return None

    def add_engine(self, dev: SimDevice, tenant: str, charge_weights: bool = True) -> SimReplica | None:
        """Open an engine of ``tenant`` on ``dev`` (reserving its weights unless they are free)."""
        cost = cost_for(self.model_of(tenant), dev.kind)
        wb = cost.weight_bytes if charge_weights else 0
        if wb and not (dev.mem.make_room(wb, self.now) and dev.mem.try_alloc("weights", wb, self.now)):
            if not self._evict_idle_engine(dev, wb):
                return None
        eng = SimReplica(self.next_id("e"), tenant, dev, cost, self.cfg, self._on_first_token, self._on_finish, wb)
        eng.tpot_s = self.snapshot.tenants[tenant].sla.tpot_ms / 1000.0
        eng.ttft_s = self.snapshot.tenants[tenant].sla.ttft_ms / 1000.0
        dev.engines.append(eng)
        if tenant not in dev.state.tenants:
            dev.state.tenants.append(tenant)
        if dev.state.home_tenant is None:
            dev.state.home_tenant = tenant
        return eng

    def _evict_idle_engine(self, dev: SimDevice, need: int) -> bool:
        """Free the weights of idle engines (dynamic placements only) until ``need`` bytes fit."""
        if not self.dynamic:
            return False
        for e in list(dev.engines):
            if e.outstanding == 0 and e is not dev.cur and e.weights_bytes:
                self.remove_engine(dev, e)
                if dev.mem.try_alloc("weights", need, self.now):
                    return True
        return False

    def remove_engine(self, dev: SimDevice, eng: SimReplica) -> None:
        dev.engines.remove(eng)
        if eng.weights_bytes:
            dev.mem.release("weights", eng.weights_bytes, self.now)
        if not any(e.tenant == eng.tenant for e in dev.engines):
            dev.state.tenants.remove(eng.tenant)
        if dev.last_engine is eng:
            dev.last_engine = None

    # ---------------------------------------------------------------- snapshot upkeep
    def refresh(self, dev: SimDevice) -> None:
        """Mirror one device's state into the snapshot the policy reads (own tenant's engines; guest lanes apart)."""
        if dev.parent is not None:
            dev = dev.parent
        s = dev.state
        engines = dev.engines
        if len(engines) == 1:  # the common case, spelled out (oldest_pending() inlined)
            e = engines[0]
            waiting, prefilling = e.waiting, e.prefilling
            q, r, qp, kv = len(waiting), len(prefilling) + len(e.decoding), e.queued_prefill, e.decode_kv
            oldest = math.inf
            if prefilling:
                oldest = prefilling[0].arrival
            if waiting and waiting[0].arrival < oldest:
                oldest = waiting[0].arrival
        else:
            q = r = qp = kv = 0
            oldest = math.inf
            for e in engines:
                q += len(e.waiting)
                r += len(e.prefilling) + len(e.decoding)
                qp += e.queued_prefill
                kv += e.decode_kv
                o = e.oldest_pending()
                if o < oldest:
                    oldest = o
        s.queued, s.running, s.queued_prefill_tokens, s.decode_kv_tokens, s.oldest_pending_s = q, r, qp, kv, oldest
        m = dev.mem
        s.used_bytes, s.kv_bytes, s.staged_bytes = m.used, m.by_kind["kv"], m.by_kind["staged"]
        s.busy = dev.cur is not None
        s.guest_yield = dev.f_dyn
        s.busy_until_s = dev.cur_end if s.busy else self.now
        if dev.lanes or s.guest_engines:
            s.guest_engines = {e.tenant: (e.outstanding, e.queued_prefill, not e.draining)
                               for lane in dev.lanes for e in lane.engines}
        if self.dynamic:
            by: dict[str, int] = {}
            for e in dev.engines:
                if e.outstanding:
                    by[e.tenant] = by.get(e.tenant, 0) + e.outstanding
            s.outstanding_by_tenant = by
        self.snapshot.touch(s)

    def _on_first_token(self, req: SimRequest, now: float) -> None:
        ts = self.snapshot.tenants[req.tenant]
        ts.queued -= 1
        ts.running += 1
        if self._budget is not None and now - req.arrival > req.ttft_t:
            self._late(req)

    def _on_finish(self, req: SimRequest, now: float) -> None:
        self.snapshot.tenants[req.tenant].running -= 1
        tpot = (now - req.first_token) / (req.output - 1) if req.output > 1 else None
        if self._budget is not None and not req.late and tpot is not None and tpot > req.tpot_t:
            self._late(req)
        self._observe_end(req, now, missed(req.first_token - req.arrival, tpot, self.request_targets(req)))

    def _observe_end(self, req: SimRequest, now: float, violated: bool) -> None:
        """The tenant's recent attainment, measured as the live scheduler measures it (:class:`Attainment`)."""
        a = self._attainment.get(req.tenant)
        if a is None:
            a = self._attainment[req.tenant] = Attainment()
        a.observe(now, violated)
        ts = self.snapshot.tenants[req.tenant]
        ts.violation_rate, ts.recent_requests = a.rate, a.requests

    # ---------------------------------------------------------------- early stop
    def stop_above(self, workload: Workload, bound: float, min_requests: int) -> None:
        """Stop the run as soon as it is known to violate more than ``bound``: in aggregate, or for a tenant with
        at least ``min_requests`` requests in ``workload`` (DESIGN §9's per-tenant rule). The result then carries
        ``stopped_early`` and violation counts that are lower bounds."""
        n: dict[str, int] = {}
        for r in workload.requests:
            n[r.tenant] = n.get(r.tenant, 0) + 1
        self._budget = {t: bound * k for t, k in n.items() if k >= min_requests}
        self._budget[""] = bound * len(workload.requests)
        self._violations = {t: 0 for t in [*n, ""]}
        self._set_targets()

    def _set_targets(self) -> None:
        """Price every arriving request's SLA targets (for an early stop, a deadline-ordered placement or
        ``deadline_chunks``)."""
        for t in self.tenants_cfg.tenants:
            self._targets[t.name] = RequestTargets(t.sla, t.model.config, self.cfg.max_batched_tokens)

    def tpot_target(self, req: SimRequest) -> float:
        """``req``'s TPOT target (s): priced at its arrival when the run needs targets throughout, else now."""
        return self.request_targets(req)[1]

    def request_targets(self, req: SimRequest) -> tuple[float, float]:
        """``req``'s (TTFT, TPOT) targets (s): priced at its arrival when the run needs targets throughout, else
        on first use (and kept on the request)."""
        if req.tpot_t != math.inf:
            return req.ttft_t, req.tpot_t
        tg = self._targets.get(req.tenant) or self._lazy_targets.get(req.tenant)
        if tg is None:
            t = next(t for t in self.tenants_cfg.tenants if t.name == req.tenant)
            tg = self._lazy_targets[req.tenant] = RequestTargets(t.sla, t.model.config, self.cfg.max_batched_tokens)
        req.ttft_t, req.tpot_t = tg(req.input, req.output)
        return req.ttft_t, req.tpot_t

    def _late(self, req: SimRequest) -> None:
        req.late = True
        v = self._violations
        v[req.tenant] += 1
        v[""] += 1
        b = self._budget
        if v[""] > b[""] or v[req.tenant] > b.get(req.tenant, math.inf):  # type: ignore[index, union-attr]
            self.stopped_early = True

    # ---------------------------------------------------------------- setup
    def offered(self, workload: Workload) -> dict[str, OfferedLoad]:
        """Average offered load per tenant, costed on the kind of the cluster's first device."""
        return offered_loads(workload, self.cluster.devices[0].kind)

    def _place(self, workload: Workload) -> None:
        placement = self.policy.initial_placement(self.snapshot, self.offered(workload))
        self.dynamic, self.weights_free = placement.dynamic_engines, placement.weights_free
        if (placement.sharing == "edf" or self.cfg.deadline_chunks) and not self._targets:
            self._set_targets()
        for did, tenants in placement.assign.items():
            dev = self.devices[did]
            dev.sharing = placement.sharing
            for t in tenants:
                if self.add_engine(dev, t) is None:
                    raise ValueError(f"placement puts more weights on {did} than fit in its memory")
            dev.state.home_tenant = tenants[0] if tenants else None
        for dev in self.devices.values():
            dev.sharing = placement.sharing
            dev.quantum = placement.quantum
            dev.weights = {t: w for (d, t), w in placement.weights.items() if d == dev.id}
            if placement.sharing == "switch":
                dev.switch_cost = self._switch_cost_fn(dev)
            self.refresh(dev)

    def _switch_cost_fn(self, dev: SimDevice) -> Callable[[SimReplica], float]:
        def cost(eng: SimReplica) -> float:
            fresh = eng.eid in self._fresh
            self._fresh.discard(eng.eid)
            return self.policy.switch_cost_s(dev.kind, eng.tenant, resident=not fresh)
        return cost

    # ---------------------------------------------------------------- events
    def _on_arrival(self, wr) -> None:
        req = SimRequest(wr.request_id, wr.tenant, wr.arrival_s, wr.input_tokens, wr.output_tokens)
        if self._targets:
            req.ttft_t, req.tpot_t = self._targets[req.tenant](req.input, req.output)
        self.requests.append(req)
        ts = self.snapshot.tenants.get(req.tenant)
        if ts is None:
            raise ValueError(f"workload request {wr.request_id} names unknown tenant {wr.tenant!r}")
        ts.queued += 1
        self._observe_arrival(ts, req)
        if ts.queued > self._max_queue[req.tenant]:
            self._reject(req, ts)
            return
        self.snapshot.now = self.now
        did = self.policy.route(req.tenant, req.input, req.output, self.snapshot)
        if did is None:
            self._reject(req, ts)
            return
        dev = self.devices[did]
        eng = self.engine_of(dev, req.tenant)
        if eng is None:
            if not self.dynamic:
                raise ValueError(f"policy routed {req.tenant} to {did}, which holds no engine of it")
            eng = self.add_engine(dev, req.tenant, charge_weights=not self.weights_free)
            if eng is None:
                self._reject(req, ts)
                return
            self._fresh.add(eng.eid)
        if eng.kv_need(req) > dev.mem.limit - dev.mem.by_kind["weights"]:
            self._reject(req, ts, FAILED)  # can never fit on this device
            return
        eng.enqueue(req)
        target = eng.device
        if target.cur is None:
            target.start(self.now)
        else:
            target.interrupt(self.now)
        dev.sync_lanes(self.now)
        self.refresh(dev)
        if self.policy.wants_arrival:
            self.leases.apply(self.policy.decide(Trigger("arrival", req.tenant, did), self.snapshot, self.whatif))

    def _observe_arrival(self, ts: TenantState, req: SimRequest) -> None:
        """Recent arrival rate and lengths, measured as the live scheduler measures them (:class:`ArrivalStats`)."""
        st = self._arrivals.get(ts.name)
        if st is None:
            st = self._arrivals[ts.name] = ArrivalStats(start=0.0)
        st.observe(self.now, req.input, req.output)
        ts.rate_rps, ts.mean_input, ts.mean_output = st.rate_rps, st.mean_input, st.mean_output

    def _reject(self, req: SimRequest, ts: TenantState, status: int = REJECTED) -> None:
        req.status = status
        ts.queued -= 1
        self.rejected += 1
        if self._budget is not None and not req.late:
            self._late(req)
        self._observe_end(req, self.now, True)

    def _on_step(self, dev: SimDevice) -> None:
        eng = dev.finish(self.now)
        if self.weights_free and eng.outstanding == 0 and eng.weights_bytes == 0 and eng in dev.engines:
            self.remove_engine(dev, eng)  # free weights: an idle extra engine costs nothing to reopen
        if eng.draining and eng.outstanding == 0:
            if dev.parent is not None:
                self.leases.lane_drained(dev)
                self.refresh(dev)
                return
            self.leases.drained(dev, eng)
        dev.start(self.now)
        if dev.parent is None:
            dev.sync_lanes(self.now)
        self.refresh(dev)

    def wake(self, dev: SimDevice) -> None:
        """Re-plan a device after something outside it changed (memory freed, lease change)."""
        for d in [dev, *dev.lanes]:
            if d.cur is None:
                d.start(self.now)
            else:
                d.interrupt(self.now)
        self.refresh(dev)

    # ---------------------------------------------------------------- main loop
    def run(self, workload: Workload, progress: Callable[[float], None] | None = None) -> SimResult:
        """Replay ``workload``; ``progress(fraction)`` is called now and then (for a progress bar)."""
        from shared.sim.whatif import WhatIf
        self.whatif = WhatIf.for_cluster(self.cluster, self.snapshot, self.cfg)
        self._place(workload)
        reqs = workload.requests
        n = len(reqs)
        last_arrival = reqs[-1].arrival_s if reqs else 0.0
        stop = last_arrival + self.cfg.drain_s
        tick = self.policy.tick_s
        if tick:
            self.push(tick, TICK, None)
        heap = self._heap
        i = 0
        report_every = max(1, n // 200)
        while not self.stopped_early:
            if heap and (i >= n or heap[0][0] <= reqs[i].arrival_s):
                t, _, kind, obj, ver = heapq.heappop(heap)
                if t > stop:
                    break
                self.now = t
                if kind == STEP:
                    if ver != obj.version:
                        continue
                    self._on_step(obj)
                elif kind == TICK:
                    self.snapshot.now = t
                    self.leases.apply(self.policy.decide(Trigger("tick"), self.snapshot, self.whatif))
                    if i < n or any(d.cur is not None for d in self.devices.values()):
                        self.push(t + tick, TICK, None)  # type: ignore[operator]
                else:
                    self.leases.on_event(kind, obj, ver)
                self.events += 1
            elif i < n:
                wr = reqs[i]
                i += 1
                self.now = wr.arrival_s
                self._on_arrival(wr)
                self.events += 1
                if progress is not None and i % report_every == 0:
                    progress(i / n)
            else:
                break
        for r in self.requests:
            if r.status < 2:
                r.status = FAILED
        if progress is not None:
            progress(1.0)
        window = workload.duration_s or last_arrival or 1.0
        result = collect(self, workload, window)
        if self.stopped_early:  # its figures cover the requests that had arrived; the stop proves a violation
            result.extra["stopped_early"] = True
        return result
