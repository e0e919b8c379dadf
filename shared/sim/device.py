"""A simulated device: memory, the engines it holds, and which engine runs next (one step at a time)."""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

from shared.config import DeviceConfig
from shared.costmodel.profiles import DeviceProfile
from shared.guest_share import LANE_WINDOW_S, MAX_OWED_S, MIN_GUEST_SHARE, YIELD_MARGIN, own_yield, segment_payment
from shared.sim.anatomy import BusyBins
from shared.sim.replica import SimReplica
from shared.sim.sim_lease import ACTIVE, DRAINING, SimLease
from shared.sim.memory import DeviceMemory


class LaneHistory:
    """Recent steps of a device with guest lanes, ``(end, seconds, guest?, nanoseconds)``, with running sums of
    the guest and total time in integer nanoseconds (exact: no drift however long the run).

    :meth:`guest_within` decides ``guest <= frac * total`` exactly as summing the window's float durations left to
    right would: the integer sums are within half a nanosecond per step of the exact sums, the float sums within
    ~1e-13 s, so outside a margin of one nanosecond per step the two agree; inside it (near-ties, rare) the float
    sums are computed as before."""

    __slots__ = ("steps", "guest_ns", "total_ns")

    def __init__(self) -> None:
        self.steps: deque = deque()
        self.guest_ns = self.total_ns = 0

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> tuple:
        return self.steps[i]

    def append(self, end: float, dur: float, guest: bool) -> None:
        ns = round(dur * 1e9)
        self.steps.append((end, dur, guest, ns))
        self.total_ns += ns
        if guest:
            self.guest_ns += ns

    def trim(self, before: float) -> None:
        """Forget steps that ended before ``before``."""
        h = self.steps
        while h and h[0][0] < before:
            _, _, guest, ns = h.popleft()
            self.total_ns -= ns
            if guest:
                self.guest_ns -= ns

    def guest_within(self, frac: float) -> bool:
        """Guest time in the window ≤ ``frac`` × all time in it."""
        diff = self.guest_ns - frac * self.total_ns
        margin = len(self.steps) + 2
        if diff < -margin:
            return True
        if diff > margin:
            return False
        h = self.steps
        g = sum(d for _, d, guest, _ in h if guest)
        total = sum(d for _, d, _, _ in h)
        return g <= frac * total


class SimDevice:
    """Runs one engine step at a time. ``sharing`` decides which ready engine goes next (see Placement)."""

    __slots__ = ("id", "kind", "host", "profile", "mem", "engines", "sharing", "weights", "cur", "cur_start",
                 "cur_end", "cur_dur", "version", "rr", "busy_s", "guest_busy_s", "work_s", "hosted", "last_engine",
                 "quantum_used", "quantum", "schedule", "switch_cost", "state", "pending_switch_s", "switches",
                 "used_s",
                 "parent", "lanes", "lease", "home_active", "f_dyn", "yield_margin", "exclusive_lanes", "hist", "bins",
                 "seg_debt")

    def __init__(self, cfg: DeviceConfig, profile: DeviceProfile, headroom_fraction: float,
                 schedule: Callable[["SimDevice", float, int], None]) -> None:
        self.id, self.kind, self.host, self.profile = cfg.id, cfg.kind, cfg.host, profile
        self.mem = DeviceMemory(cfg.memory_bytes, headroom_fraction)
        self.engines: list[SimReplica] = []
        self.sharing = "exclusive"
        self.weights: dict[str, float] = {}
        self.used_s: dict[str, float] = {}  # device time per engine (weighted sharing)
        self.cur: SimReplica | None = None
        self.cur_start = self.cur_end = self.cur_dur = 0.0
        self.version = 0
        self.rr = 0
        self.busy_s = 0.0  # own steps, as long as they ran (stretched by what they yielded to guests)
        self.guest_busy_s = 0.0  # guests' work here: lane iterations, offloaded segments (SimLease.account)
        self.work_s = 0.0  # time the device worked: own steps without their stretch, lanes, offloaded segments
        self.hosted: list[SimLease] = []  # leases whose segments run here
        self.last_engine: SimReplica | None = None
        self.quantum_used = 0
        self.quantum = 8
        self.schedule = schedule
        self.switch_cost: Callable[[SimReplica], float] | None = None
        self.state = None  # the DeviceState mirrored for policies
        self.pending_switch_s = 0.0
        self.switches = 0
        self.parent: SimDevice | None = None  # set on a guest lane: the device whose time and memory it shares
        self.lanes: list[SimDevice] = []  # guest lanes ("sequences" leases) running on this device
        self.lease: SimLease | None = None  # the lease a guest lane runs under
        self.home_active = False  # lanes: was the parent's own tenant active when the current step was planned
        self.f_dyn = 0.0  # share of this device guests get while its own tenant is active (set every own step)
        self.yield_margin = YIELD_MARGIN
        # Guest lanes ("sequences" leases) take whole iterations of this device at full speed, one at a time
        # with its own steps, as a worker's compute thread runs them (services/worker/lanes.py); False: the
        # older fluid model, where a lane runs beside the own tenant slowed to its share.
        self.exclusive_lanes = True
        self.hist = LaneHistory()  # exclusive lanes: recent steps, for the guests' share
        self.bins: BusyBins | None = None  # busy time per bin, when the run records it (a lane shares its device's)
        self.seg_debt = 0.0  # exclusive lanes: segment time run here while busy, not yet paid (kept on the device)

    def make_lane(self, lease: SimLease) -> "SimDevice":
        """A guest lane: its own step loop over this device's memory, running under ``lease``'s share."""
        lane = SimDevice.__new__(SimDevice)
        for name in SimDevice.__slots__:
            setattr(lane, name, getattr(self, name))
        lane.engines, lane.weights, lane.used_s, lane.hosted, lane.lanes = [], {}, {}, [], []
        lane.cur, lane.version, lane.rr, lane.busy_s, lane.guest_busy_s, lane.work_s = None, 0, 0, 0.0, 0.0, 0.0
        lane.last_engine, lane.quantum_used, lane.switches, lane.switch_cost = None, 0, 0, None
        lane.sharing, lane.parent, lane.lease, lane.home_active = "exclusive", self, lease, False
        lane.hist = self.hist
        self.lanes.append(lane)
        return lane

    def own_active(self) -> bool:
        """The device's own tenant has work (busy or queued)."""
        if self.cur is not None:
            return True
        for e in self.engines:
            if e.waiting or e.prefilling or e.decoding:
                return True
        return False

    def has_work(self) -> bool:
        """The device has work: its own tenant's, or a guest lane's (busy or queued)."""
        if self.own_active():
            return True
        for lane in self.lanes:
            if lane.own_active():
                return True
        return False

    def owe_segments(self, seconds: float, now: float) -> None:
        """A driver ran ``seconds`` of offloaded segments here. With exclusive lanes the device's time is
        conserved: segments run while it has work are owed, and its next steps (own or lane) are stretched to pay
        (:func:`~shared.guest_share.segment_payment`); a closed-form run is cut so that the next step pays.
        Segments run while it is idle cost nothing."""
        if not self.exclusive_lanes or not self.has_work():
            return
        self.seg_debt = min(MAX_OWED_S, self.seg_debt + seconds)
        self.interrupt(now)

    def lane_share(self) -> float:
        """Share of the parent's time this lane gets now (see :meth:`share_for`)."""
        assert self.parent is not None and self.lease is not None
        return self.parent.share_for(self.lease)
    # ---------------------------------------------------------------- guest shares
    def guest_share(self, mode: str | None = None) -> float:
        """Share of this device's time taken by active leases (of ``mode`` only, if given)."""
        return sum(lease.share for lease in self.hosted
                   if lease.state in (ACTIVE, DRAINING) and (mode is None or lease.mode == mode))

    def committed_share(self) -> float:
        """Share promised to leases, staging ones included (what a new grant must fit beside)."""
        return sum(lease.share for lease in self.hosted)

    def share_for(self, lease: SimLease) -> float:
        """Fraction of this device's time ``lease`` gets now. The device's own tenant comes first: while it is
        active, guests split only what it yields (``f_dyn``: nothing while it has prompts to prefill, otherwise
        the TPOT slack it can spare, capped by the leases' shares); while it is idle, a lease gets all that other
        leases leave."""
        running = [x for x in self.hosted if x.state in (ACTIVE, DRAINING)]
        if self.own_active():
            total = sum(x.share for x in running) or 1.0
            return max(MIN_GUEST_SHARE, self.f_dyn * lease.share / total)
        others = sum(x.share for x in running if x is not lease)
        return max(lease.share, 1.0 - others)

    def update_slowdown(self, now: float) -> None:
        """Leases changed: cut the current run so that the next step re-plans the split of time."""
        self.interrupt(now)
        self.sync_lanes(now, force=True)

    # ---------------------------------------------------------------- stepping
    def _pick(self, ready: list[SimReplica]) -> SimReplica:
        if len(ready) == 1:
            return ready[0]
        if self.sharing == "weighted":
            return min(ready, key=lambda e: (self.used_s.get(e.eid, 0.0) / self.weights.get(e.tenant, 1.0), e.eid))
        if self.sharing == "edf":
            return min(ready, key=lambda e: (e.deadline(), e.eid))
        if self.sharing == "switch":
            last = self.last_engine
            if last in ready and self.quantum_used < self.quantum:
                return last  # type: ignore[return-value]
            others = [e for e in ready if e is not last] or ready
            return min(others, key=lambda e: (e.oldest_pending() if math.isfinite(e.oldest_pending())
                                              else e.decoding[0].arrival if e.decoding else math.inf, e.eid))
        self.rr += 1
        return ready[self.rr % len(ready)]

    def start(self, now: float) -> None:
        """If idle, pick an engine with work and schedule its next step."""
        if self.exclusive_lanes:
            if self.parent is not None:  # the device decides when a lane runs
                p = self.parent
                if p.cur is not None:
                    p.interrupt(now)  # a closed-form run ends at the iteration in flight
                else:
                    p.start(now)
                return
            if self.cur is not None:
                return
            lanes = self.lanes
            if lanes:
                for lane in lanes:
                    if lane.cur is not None:
                        return
                lane, waiting = self._lane_due(now)
                if lane is not None:
                    lane._step(now, single=True)
                    return
                self._step(now, single=waiting)
                return
        elif self.cur is not None:
            return
        self._step(now, single=False)

    def _lane_due(self, now: float) -> tuple["SimDevice | None", bool]:
        """(lane to run now, whether a lane has work): a lane runs when the own tenant is idle, never while it has
        prompts to prefill, never twice in a row while it decodes (a run of lane iterations would stall its
        tokens), and otherwise while the guest time over the last ``LANE_WINDOW_S`` is within the share the own
        tenant yields (``f_dyn``, at least ``MIN_GUEST_SHARE``); the lane that ran longest ago goes first."""
        lane = None  # the ready lane with the earliest cur_end (the first of equals)
        for x in self.lanes:
            for e in x.engines:
                if e.ready(now):
                    if lane is None or x.cur_end < lane.cur_end:
                        lane = x
                    break
        if lane is None:
            return None, False
        engines = self.engines
        for e in engines:
            if e.ready(now):
                break
        else:
            return lane, True
        for e in engines:
            if e.waiting or e.prefilling:
                return None, True  # the own tenant's prompts first (its TTFT), as in the fluid model
        h = self.hist
        h.trim(now - LANE_WINDOW_S)
        if h and h[-1][2]:
            for e in engines:
                if e.decoding:
                    return None, True  # one lane iteration at most between two of the own tenant's (its TPOT)
        if h.guest_within(max(MIN_GUEST_SHARE, self.f_dyn - self.guest_share("segments"))):
            return lane, True
        return None, True

    def _step(self, now: float, single: bool) -> None:
        """Pick one of this device's (or lane's) engines with work and schedule its next step (one iteration when
        ``single``, so that a waiting lane gets its turn at the next boundary)."""
        engines = self.engines
        if len(engines) == 1:
            eng = engines[0]
            if not eng.ready(now):
                return
            n_ready = 1
        else:
            ready = [e for e in engines if e.ready(now)]
            if not ready:
                return
            eng = self._pick(ready)
            n_ready = len(ready)
        if self.parent is not None:
            self.home_active = self.parent.own_active()
            eng.slowdown = 1.0 if self.exclusive_lanes else 1.0 / max(1e-6, self.lane_share())
        else:
            eng.slowdown = 1.0
        n, dur = eng.plan(now, exclusive=n_ready == 1 and not single)
        if self.parent is None and (self.hosted or self.f_dyn):
            dur = self._yield(eng, n, dur, now)
        if self.exclusive_lanes:
            dev = self.parent or self
            if dev.seg_debt > 0:
                pay = segment_payment(dev.seg_debt, dur, dev.guest_share("segments"))
                if pay > 0:
                    s = 1.0 + pay / dur
                    if eng.run is not None:
                        eng.run = eng.run[:5] + (s,)
                    eng.slowdown = s
                    dur += pay
        if self.sharing == "switch":
            if eng is not self.last_engine and self.last_engine is not None and self.switch_cost is not None:
                dur += self.switch_cost(eng)
                self.switches += 1
                self.quantum_used = 0
            self.quantum_used += 1
        self.last_engine = eng
        self.cur, self.cur_start, self.cur_dur = eng, now, dur
        self.cur_end = now + dur
        self.version += 1
        self.schedule(self, self.cur_end, self.version)

    def _yield(self, eng: SimReplica, n: int, dur: float, now: float) -> float:
        """Own step with guests present: yield ``f_dyn`` of the device to them. Nothing while the own tenant has
        prompts waiting or being prefilled (its TTFT comes first); otherwise as much as keeps its (longest)
        iteration, stretched, within ``yield_margin`` × its TPOT target, capped by the leases' shares."""
        running = [x for x in self.hosted if x.state in (ACTIVE, DRAINING)]
        old = self.f_dyn
        if not running or eng.waiting or eng.prefilling:
            f = 0.0
        else:
            if eng.run is not None:
                t0, a, c, k0, b, _ = eng.run
                t_last = a + c * (k0 + (n - 1) * b)
            else:
                t_last = dur
            f = own_yield(sum(x.share for x in running), t_last, eng.tpot_s, self.yield_margin)
        self.f_dyn = f
        if self.exclusive_lanes:
            return dur  # lanes take whole iterations; segments are paid for as they run (owe_segments)
        if f != old:
            self.sync_lanes(now, force=True)
        if f <= 0.0:
            return dur
        s = 1.0 / (1.0 - f)
        if eng.run is not None:
            eng.run = eng.run[:5] + (s,)
        eng.slowdown = s
        return dur * s

    def finish(self, now: float) -> SimReplica:
        """The current step ended at ``now``: apply it and free the device."""
        eng = self.cur
        assert eng is not None
        dur = now - self.cur_start
        dev = self.parent or self
        dev.work_s += dur / eng.slowdown  # a stretched own step's extra time is its guests'
        if self.exclusive_lanes and eng.slowdown != 1.0:
            dev.seg_debt = max(0.0, dev.seg_debt - (dur - dur / eng.slowdown))  # segment time paid
        if self.parent is not None:  # guest lane: its share of the step is guest time on the parent
            self.parent.guest_busy_s += dur / eng.slowdown
            if self.lease is not None:
                self.lease.lane_busy_s += dur / eng.slowdown
        else:
            self.busy_s += dur
        if self.bins is not None:  # a stretched own step's extra time is its guests' (recorded as theirs)
            self.bins.add(self.cur_start, now, self.parent is not None, 1.0 / eng.slowdown)
        if self.exclusive_lanes and (self.lanes or self.parent is not None):
            self.hist.append(now, dur, self.parent is not None)
        if self.sharing == "weighted":
            self.used_s[eng.eid] = self.used_s.get(eng.eid, 0.0) + dur
        eng.complete(now, dur)
        self.cur = None
        return eng

    def interrupt(self, now: float) -> None:
        """Something changed: cut a closed-form run at the iteration in flight so the next boundary re-plans."""
        eng = self.cur
        if eng is None or eng.run is None or eng.step_n <= 1:
            return
        done = eng.run_iters_done(now)
        n_new = done + 1
        if n_new >= eng.step_n:
            return
        eng.step_n = n_new
        end = eng.run[0] + eng.run_time(n_new)
        self.cur_end = end
        self.version += 1
        self.schedule(self, end, self.version)

    def outstanding(self) -> int:
        return sum(e.outstanding for e in self.engines)

    def sync_lanes(self, now: float, force: bool = False) -> None:
        """The own tenant went from idle to active or back (or its yield changed): lanes re-time their step."""
        if not self.lanes or self.exclusive_lanes:
            return
        active = self.own_active()
        for lane in self.lanes:
            if lane.cur is not None and (force or lane.home_active != active):
                lane.home_active = active
                lane.retime(now, 1.0 / max(1e-6, lane.lane_share()))

    def retime(self, now: float, slow: float) -> None:
        """Change the speed of the step in flight: the work left runs at the new slowdown from ``now``."""
        eng = self.cur
        if eng is None:
            return
        if eng.run is not None and eng.step_n > 1:
            self.interrupt(now)
            return
        old = eng.slowdown
        if abs(old - slow) < 1e-12 or self.cur_end <= now:
            return
        left = (self.cur_end - now) / old * slow
        eng.slowdown = slow
        self.cur_end = now + left
        self.version += 1
        self.schedule(self, self.cur_end, self.version)
