"""An adaptive per-tenant concurrency limit that keeps accepted requests inside their SLA under overload.

A bounded queue alone does not: offered 2x its capacity, a tenant fills ``max_queue`` and every accepted request
then waits about ``max_queue / capacity`` seconds for its first token, so the gateway accepts work it is bound to
serve late. The limiter is additive-increase / multiplicative-decrease on the SLA itself, as TCP congestion control
is on packet loss:

* each completed request reports its TTFT (admission at this gateway to its first token) and TPOT; a request over
  ``ttft_target_s`` or ``tpot_target_s`` (a fraction of the tenant's SLA, leaving room for the network and the
  client) cuts the limit to ``DECREASE x`` the tenant's in-flight count at that moment, at most once per
  generation of requests (only a request admitted after the previous cut can cut again);
* a request within the targets raises the limit by ``1 / limit`` (about one per round trip), and only when the
  limit is in use, so a quiet period does not inflate it;
* until the first cut the limit is the tenant's ``max_queue``: a tenant that never overloads never sees it;
* the limit never goes below ``MIN_LIMIT`` (nor above ``max_queue``): a few requests in flight do not make each
  other late, so a short stall of the device or the host must not turn into refusals.

The signal is the latency the tenant's own requests get, so the limit follows whatever capacity is left to the
tenant (batch size, a slow or shared device, CPU contention) without a model of it. Pure: no clock, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECREASE = 0.7
# Below this many requests in flight, concurrency is not what makes a request late (a batch of a few sequences
# costs about what one does), so a late request is blamed on something shedding cannot fix and the limit stays.
MIN_LIMIT = 8.0


@dataclass
class SlaLimiter:
    """Concurrency limit of one tenant at one gateway instance."""

    ttft_target_s: float
    tpot_target_s: float
    max_limit: float
    limit: float = math.inf  # set to max_limit in __post_init__
    generation: int = 0  # bumped at every cut
    cuts: int = 0
    good: int = 0
    over: int = 0

    def __post_init__(self) -> None:
        self.limit = float(self.max_limit)

    @property
    def current(self) -> int:
        """Requests the tenant may have in flight now."""
        return min(int(self.max_limit), max(int(MIN_LIMIT), math.floor(self.limit)))

    def allows(self, inflight: int) -> bool:
        return inflight < self.current

    def observe(self, *, generation: int, inflight: int, ttft_s: float | None, tpot_s: float | None) -> None:
        """Feed one completed request: its admission ``generation``, the tenant's in-flight count now (the request
        itself included) and what it measured (None when not measurable, e.g. TPOT of a one-token answer)."""
        late = (ttft_s is not None and ttft_s > self.ttft_target_s) or \
               (tpot_s is not None and tpot_s > self.tpot_target_s)
        if late:
            self.over += 1
            if generation >= self.generation:
                self.limit = max(MIN_LIMIT, min(self.limit, float(inflight)) * DECREASE)
                self.generation += 1
                self.cuts += 1
            return
        self.good += 1
        if inflight >= self.limit / 2:
            self.limit = min(float(self.max_limit), self.limit + 1.0 / self.limit)
