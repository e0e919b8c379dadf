"""Admission control: per-tenant bounded in-flight and quotas (429), a predicted-TTFT guard and a global in-flight
bound (503).

Pure and single-threaded (the gateway's event loop); the clock is injected so tests can move time. Bounds are per
gateway instance: with several replicas behind a load balancer each enforces its share.

The TTFT guard keeps accepted requests inside their SLA under overload. A bounded queue alone does not: at 2x
capacity an open-loop load fills ``max_queue`` and every accepted request then waits ``max_queue / capacity``
seconds for its first token. The guard applies Little's law to the tenant's requests that wait for their first
token at this gateway: with ``waiting`` of them and first tokens arriving at ``rate`` per second while any wait,
a new request should see its first token after about ``(waiting + 1) / rate`` seconds. Above ``ttft_fraction``
of the tenant's TTFT target the request is refused with 503 and a Retry-After of the predicted excess. The rate is
measured on a clock that runs only while requests wait (idle time neither dilutes nor expires it), so it follows
the capacity actually left to the tenant, whatever the cause (batch size, CPU contention, a slow device).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.gateway.core import ApiError
from shared.config import TenantConfig

WINDOW_S = 60.0
RATE_SAMPLES = 128  # first-token stamps kept per tenant for the rate estimate
RATE_MIN_SAMPLES = 8  # below this the guard does not judge (cold start)
RATE_WINDOW_BUSY_S = 10.0  # stamps older than this much waiting time are dropped


@dataclass
class Ticket:
    """One admitted request; hand it back with :meth:`Admission.release` exactly once."""

    tenant: str
    tokens: int
    ts: float
    released: bool = False
    waiting_first_token: bool = True


@dataclass
class FirstTokenRate:
    """Little's law on the requests waiting for their first token; times on a clock that runs while any wait."""

    waiting: int = 0
    busy_s: float = 0.0  # total time with waiting > 0
    last_ts: float | None = None
    stamps: deque = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))  # busy_s at each first token

    def _advance(self, now: float) -> None:
        if self.last_ts is not None and self.waiting > 0:
            self.busy_s += max(0.0, now - self.last_ts)
        self.last_ts = now

    def started(self, now: float) -> None:
        self._advance(now)
        self.waiting += 1

    def first_token(self, now: float) -> None:
        self._advance(now)
        self.waiting = max(0, self.waiting - 1)
        self.stamps.append(self.busy_s)

    def abandoned(self, now: float) -> None:
        """The request ended without a first token (error, cancel): it leaves the queue without a sample."""
        self._advance(now)
        self.waiting = max(0, self.waiting - 1)

    def rate(self, now: float) -> float | None:
        """First tokens per second of waiting time over the recent window; None until enough samples."""
        self._advance(now)
        while self.stamps and self.stamps[0] < self.busy_s - RATE_WINDOW_BUSY_S:
            self.stamps.popleft()
        if len(self.stamps) < RATE_MIN_SAMPLES:
            return None
        span = self.busy_s - self.stamps[0]
        return len(self.stamps) / span if span > 0 else None

    def predicted_ttft_s(self, now: float) -> float | None:
        """Expected wait for the first token of a request admitted now."""
        r = self.rate(now)
        return None if r is None else (self.waiting + 1) / r


@dataclass
class _TenantState:
    inflight: int = 0
    window: deque = field(default_factory=deque)  # (ts, tokens) charged in the last WINDOW_S
    window_tokens: int = 0
    ttft: FirstTokenRate = field(default_factory=FirstTokenRate)


class Admission:
    """Decides whether a request may enter: tenant limits first (429), then the TTFT guard and the cluster bound
    (503). ``ttft_fraction`` 0 turns the guard off."""

    def __init__(self, max_inflight: int, *, ttft_fraction: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_inflight = max_inflight
        self.ttft_fraction = ttft_fraction
        self.clock = clock
        self.total_inflight = 0
        self._tenants: dict[str, _TenantState] = {}

    def inflight(self, tenant: str) -> int:
        st = self._tenants.get(tenant)
        return st.inflight if st else 0

    def tokens_in_window(self, tenant: str) -> int:
        st = self._tenants.get(tenant)
        if st is None:
            return 0
        self._expire(st, self.clock())
        return st.window_tokens

    def predicted_ttft_s(self, tenant: str) -> float | None:
        st = self._tenants.get(tenant)
        return st.ttft.predicted_ttft_s(self.clock()) if st else None

    def admit(self, tenant: TenantConfig, tokens: int) -> Ticket:
        """Admit a request that may use ``tokens`` (prompt + max_tokens) or raise a 429/503 :class:`ApiError`."""
        now = self.clock()
        st = self._tenants.setdefault(tenant.name, _TenantState())
        self._expire(st, now)
        if st.inflight >= tenant.max_queue:
            raise _quota(f"tenant '{tenant.name}' has {st.inflight} requests in flight, its queue bound is "
                         f"{tenant.max_queue}", "queue_full", 1)
        mc = tenant.quota.max_concurrency
        if mc and st.inflight >= mc:
            raise _quota(f"tenant '{tenant.name}' is at its concurrency quota of {mc} requests",
                         "concurrency_quota_exceeded", 1)
        tpm = tenant.quota.tokens_per_min
        if tpm and st.window_tokens + tokens > tpm:
            raise _quota(f"tenant '{tenant.name}' would exceed its quota of {tpm} tokens per minute "
                         f"(prompt + max_tokens = {tokens}, used {st.window_tokens})", "tokens_quota_exceeded",
                         self._tokens_retry_after(st, tokens, tpm, now))
        if self.ttft_fraction > 0:
            self._check_ttft(tenant, st, now)
        if self.total_inflight >= self.max_inflight:
            raise overloaded(f"the gateway has {self.total_inflight} requests in flight (bound {self.max_inflight})",
                             "overloaded", 1)
        st.inflight += 1
        self.total_inflight += 1
        st.ttft.started(now)
        if tpm:
            st.window.append((now, tokens))
            st.window_tokens += tokens
        return Ticket(tenant=tenant.name, tokens=tokens, ts=now)

    def first_token(self, ticket: Ticket) -> None:
        """The request's first token arrived (feeds the TTFT guard); later calls are ignored."""
        if ticket.released or not ticket.waiting_first_token:
            return
        ticket.waiting_first_token = False
        self._tenants[ticket.tenant].ttft.first_token(self.clock())

    def release(self, ticket: Ticket, *, refund: bool = False) -> None:
        """End a request; ``refund`` returns its tokens to the quota (it never reached the scheduler)."""
        if ticket.released:
            return
        ticket.released = True
        st = self._tenants[ticket.tenant]
        if ticket.waiting_first_token:
            ticket.waiting_first_token = False
            st.ttft.abandoned(self.clock())
        st.inflight -= 1
        self.total_inflight -= 1
        if refund:
            for i, (ts, tok) in enumerate(st.window):
                if ts == ticket.ts and tok == ticket.tokens:
                    del st.window[i]
                    st.window_tokens -= tok
                    break

    def _check_ttft(self, tenant: TenantConfig, st: _TenantState, now: float) -> None:
        predicted = st.ttft.predicted_ttft_s(now)
        target = self.ttft_fraction * tenant.sla.ttft_ms / 1000.0
        if predicted is not None and predicted > target:
            raise overloaded(f"tenant '{tenant.name}' is saturated: a request admitted now would wait about "
                             f"{predicted:.2f} s for its first token ({st.ttft.waiting} waiting), over the "
                             f"{target:.2f} s admission target", "ttft_over_target",
                             max(1, math.ceil(predicted - target)))

    @staticmethod
    def _expire(st: _TenantState, now: float) -> None:
        while st.window and st.window[0][0] <= now - WINDOW_S:
            st.window_tokens -= st.window.popleft()[1]

    @staticmethod
    def _tokens_retry_after(st: _TenantState, tokens: int, tpm: int, now: float) -> int:
        if tokens > tpm:
            return int(WINDOW_S)  # larger than the whole quota: it cannot fit in any minute
        need = st.window_tokens + tokens - tpm
        for ts, tok in st.window:
            need -= tok
            if need <= 0:
                return max(1, math.ceil(ts + WINDOW_S - now))
        return int(WINDOW_S)


def _quota(message: str, code: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code=code, retry_after_s=retry_after_s,
                    outcome="rejected_quota")


def overloaded(message: str, code: str, retry_after_s: int) -> ApiError:
    """503 for a saturated or unreachable cluster (also used by the service for Redis trouble and draining)."""
    return ApiError(503, message, type="service_unavailable_error", code=code, retry_after_s=retry_after_s,
                    outcome="rejected_overload")
