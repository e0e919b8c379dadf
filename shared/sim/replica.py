"""Continuous batching of one tenant's replica on one device (chunked prefill, KV reserved per request).

A :class:`SimReplica` is the simulator's stand-in for one serving engine (the real one is
:class:`shared.model.engine.Engine`). It never owns the clock: its device asks it to ``plan`` the next step (one
iteration, or a run of identical decode iterations advanced in closed form) and later to ``complete`` it.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Callable

from shared.costmodel.model_cost import ModelCost
from shared.costmodel.offload import offloaded_iteration_time
from shared.model.deadline import deadline_chunks
from shared.model.step_cap import cap_chunks
from shared.sim.request import DONE, RUNNING, SimRequest

if TYPE_CHECKING:
    from shared.sim.device import SimDevice
    from shared.sim.sim_lease import SimLease
    from shared.sim.simulator import SimConfig


class SimReplica:
    """One tenant's batch on one device. ``on_token``/``on_finish`` report to the simulator."""

    __slots__ = ("eid", "tenant", "device", "cost", "cfg", "waiting", "prefilling", "decoding", "decode_kv",
                 "queued_prefill", "offload", "slowdown", "draining", "weights_bytes", "step_chunks", "step_n",
                 "run", "on_first_token", "on_finish", "tokens_out", "busy_s", "block_bytes", "closed_form",
                 "offload_iters", "tpot_s", "ttft_s", "joining", "handback")

    def __init__(self, eid: str, tenant: str, device: "SimDevice", cost: ModelCost, cfg: "SimConfig",
                 on_first_token: Callable[[SimRequest, float], None],
                 on_finish: Callable[[SimRequest, float], None], weights_bytes: int) -> None:
        self.eid, self.tenant, self.device, self.cost, self.cfg = eid, tenant, device, cost, cfg
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.decode_kv = 0  # sum over decoding sequences of the positions the next step attends to
        self.queued_prefill = 0  # prompt tokens not yet prefilled (waiting + prefilling)
        self.offload: list["SimLease"] = []  # active segment leases of this engine
        self.slowdown = 1.0  # ≥ 1 while guests hold a share of this device
        self.draining = False
        self.weights_bytes = weights_bytes
        self.step_chunks: list[tuple[SimRequest, int]] = []
        self.step_n = 0
        self.run: tuple[float, float, float, int, int, float] | None = None  # (t0, a, c, K0, B, slow)
        self.on_first_token, self.on_finish = on_first_token, on_finish
        self.tokens_out = 0
        self.busy_s = 0.0
        self.block_bytes = cfg.kv_block_tokens * cost.kv_bytes_per_token
        self.closed_form = cfg.closed_form
        # decoding sequences handed over by a guest lane: (time their KV is here, or inf while in transit, request)
        self.joining: list[tuple[float, SimRequest]] = []
        self.handback: Callable[[SimRequest, float], bool] | None = None  # guest lane: hand a prefilled sequence home
        self.offload_iters = 0
        self.tpot_s = float("inf")  # the tenant's TPOT and TTFT targets (bound how much time its device yields
        self.ttft_s = float("inf")  # to guests)

    # ---------------------------------------------------------------- queue state
    def enqueue(self, req: SimRequest) -> None:
        req.engine = self
        self.waiting.append(req)
        self.queued_prefill += req.input

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.joining)

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding) + len(self.joining)

    def oldest_pending(self) -> float:
        """Arrival time of the oldest request still waiting for its first token (inf if none)."""
        t = math.inf
        if self.prefilling:  # admitted in arrival order, unless by deadline
            t = min(r.arrival for r in self.prefilling) if self.cfg.deadline_chunks else self.prefilling[0].arrival
        if self.waiting and self.waiting[0].arrival < t:
            t = self.waiting[0].arrival
        return t

    def deadline(self) -> float:
        """Earliest SLA deadline among this engine's requests (their targets must be set): the first token of a
        request waiting or in prefill (arrival + TTFT target), or the next token of a decoding one (first token +
        tokens so far × TPOT target); ``inf`` when it has none."""
        t = math.inf
        for q in (self.prefilling, self.waiting):
            for r in q:
                d = r.arrival + r.ttft_t
                if d < t:
                    t = d
        for r in self.decoding:
            d = r.first_token + r.generated * r.tpot_t
            if d < t:
                t = d
        return t

    def kv_need(self, req: SimRequest) -> int:
        blocks = -(-(req.input + req.output) // self.cfg.kv_block_tokens)
        return blocks * self.block_bytes

    def admit(self, now: float) -> None:
        """Move waiting requests into the batch while KV memory and the sequence limit allow (FCFS; earliest
        first-token deadline first with ``deadline_chunks``)."""
        mem, limit = self.device.mem, self.cfg.max_num_seqs
        by_deadline = self.cfg.deadline_chunks
        while self.waiting and len(self.prefilling) + len(self.decoding) < limit and not self.draining:
            req = min(self.waiting, key=lambda r: r.arrival + r.ttft_t) if by_deadline else self.waiting[0]
            need = self.kv_need(req)
            if not mem.try_alloc("kv", need, now):
                if not (mem.make_room(need, now) and mem.try_alloc("kv", need, now)):
                    break
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            req.kv_bytes = need
            req.status = RUNNING
            self.prefilling.append(req)

    def ready(self, now: float) -> bool:
        """True if a step can run now (admitting waiting requests first)."""
        if self.joining:  # sequences prefilled on a guest lane join the batch once their KV has arrived
            keep = []
            for at, r in self.joining:
                if at <= now:
                    self.decoding.append(r)
                    self.decode_kv += r.input + r.generated
                else:
                    keep.append((at, r))
            self.joining = keep
        if self.waiting:
            self.admit(now)
        return bool(self.prefilling or self.decoding)

    # ---------------------------------------------------------------- planning
    def plan(self, now: float, exclusive: bool) -> tuple[int, float]:
        """Choose the next step; returns (iterations, duration). Call only when :meth:`ready` is True."""
        dec = self.decoding
        b = len(dec)
        slow = self.slowdown
        # A run of identical decode iterations: nothing to prefill and no admissible waiting request (ready()
        # just tried to admit); only a finish (which ends the run) or an interrupt can change the batch.
        if not self.prefilling and exclusive and self.closed_form and not self.offload:
            a, c, kmax = self.cost.decode_line(b)
            n = min(r.output - r.generated for r in dec)
            if n > 1 and self.decode_kv + (n - 1) * b <= kmax:
                k0 = self.decode_kv
                self.run = (now, a, c, k0, b, slow)
                self.step_n = n
                self.step_chunks = []
                return n, slow * (n * a + c * (n * k0 + b * n * (n - 1) / 2))
        self.run = None
        self.step_n = 1
        budget = self.cfg.max_batched_tokens - b
        chunks = self.step_chunks = []
        p_tok = pairs = reads = done_prompts = 0
        if self.cfg.deadline_chunks and len(self.prefilling) > 1:
            cost, kv = self.cost, self.decode_kv
            picked = deadline_chunks(((r, r.prefilled, r.input - r.prefilled, r.arrival + r.ttft_t)
                                      for r in self.prefilling), budget, now,
                                     lambda p, pr, rd, c: slow * cost.iteration_time(b, kv, p, pr, rd, b + c))
        else:
            picked = []
            for r in self.prefilling:
                if budget <= 0:
                    break
                q = min(r.input - r.prefilled, budget)
                picked.append((r, q))
                budget -= q
        if self.cfg.step_cap_s and b and picked:  # TPOT-bounded chunks while sequences decode (step_cap.py)
            cost, kv = self.cost, self.decode_kv
            picked = cap_chunks(((r, r.prefilled, q, r.input - r.prefilled) for r, q in picked), self.cfg.step_cap_s,
                                lambda p, pr, rd, c: slow * cost.iteration_time(b, kv, p, pr, rd, b + c))
        for r, q in picked:
            chunks.append((r, q))
            p_tok += q
            pairs += q * r.prefilled + q * (q + 1) // 2
            reads += r.prefilled + q
            if r.prefilled + q >= r.input:
                done_prompts += 1
        sampled = b + done_prompts
        t_local = self.cost.iteration_time(b, self.decode_kv, p_tok, pairs, reads, sampled)
        if self.offload:
            # The driver runs an iteration offloaded only when that is predicted faster than running it alone.
            shares = [lease.guest_dev.share_for(lease) for lease in self.offload]
            timing = offloaded_iteration_time(self.cost, [lease.part for lease in self.offload], shares, b,
                                              self.decode_kv, p_tok, pairs, reads, sampled, self.cfg.micro_batches)
            if timing.total_s < t_local:
                self.offload_iters += 1
                for lease, gb, lb in zip(self.offload, timing.guest_busy_s, timing.link_bytes):
                    lease.account(gb, lb)
                    g = lease.guest_dev
                    g.work_s += gb
                    if g.bins is not None:
                        g.bins.add(now, now + gb, True)
                    g.owe_segments(gb, now)
                return 1, timing.total_s * slow
        return 1, t_local * slow

    def run_iters_done(self, t: float) -> int:
        """Iterations of the current closed-form run that have finished by time ``t``."""
        t0, a, c, k0, b, slow = self.run  # type: ignore[misc]
        tau = (t - t0) / slow
        if tau <= 0:
            return 0
        qa, qb = c * b / 2.0, a + c * k0 - c * b / 2.0
        if qa > 0:
            m = int((-qb + math.sqrt(qb * qb + 4 * qa * tau)) / (2 * qa))
        else:
            m = int(tau / qb) if qb > 0 else 0
        m = max(0, min(m, self.step_n))

        def s(i: int) -> float:
            return i * a + c * (i * k0 + b * i * (i - 1) / 2)
        while m > 0 and s(m) > tau:
            m -= 1
        while m < self.step_n and s(m + 1) <= tau:
            m += 1
        return m

    def run_time(self, n: int) -> float:
        """Duration of the first ``n`` iterations of the current run."""
        t0, a, c, k0, b, slow = self.run  # type: ignore[misc]
        return slow * (n * a + c * (n * k0 + b * n * (n - 1) / 2))

    # ---------------------------------------------------------------- completion
    def complete(self, now: float, duration: float) -> None:
        """Apply the effects of the planned step, which ended at ``now``."""
        n = self.step_n
        self.busy_s += duration
        dec = self.decoding
        b = len(dec)
        any_done = False
        if b:
            for r in dec:
                r.generated += n
                if r.generated >= r.output:
                    any_done = True
            self.decode_kv += n * b
            self.tokens_out += n * b
        if self.step_chunks:
            for r, q in self.step_chunks:
                r.prefilled += q
                self.queued_prefill -= q
                if r.prefilled >= r.input:
                    r.generated = 1
                    r.first_token = now
                    self.tokens_out += 1
                    self.on_first_token(r, now)
                    if r.output <= 1:
                        any_done = True
                    elif self.handback is not None and self.handback(r, now):
                        continue
                    dec.append(r)
                    self.decode_kv += r.input + 1
            self.prefilling = [r for r in self.prefilling if r.prefilled < r.input]
            self.step_chunks = []
        self.run = None
        if any_done:
            mem = self.device.mem
            keep = []
            for r in dec:
                if r.generated >= r.output:
                    self.decode_kv -= r.input + r.generated
                    r.finish = now
                    r.status = DONE
                    mem.release("kv", r.kv_bytes, now)
                    self.on_finish(r, now)
                else:
                    keep.append(r)
            self.decoding = keep
