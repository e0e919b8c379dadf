"""Admission control: per-tenant bounded in-flight and quotas (429), a global in-flight bound (503).

Pure and single-threaded (the gateway's event loop); the clock is injected so tests can move time. Bounds are per
gateway instance: with several replicas behind a load balancer each enforces its share.
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


@dataclass
class Ticket:
    """One admitted request; hand it back with :meth:`Admission.release` exactly once."""

    tenant: str
    tokens: int
    ts: float
    released: bool = False


@dataclass
class _TenantState:
    inflight: int = 0
    window: deque = field(default_factory=deque)  # (ts, tokens) charged in the last WINDOW_S
    window_tokens: int = 0


class Admission:
    """Decides whether a request may enter: tenant limits first (429), then the cluster bound (503)."""

    def __init__(self, max_inflight: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_inflight = max_inflight
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
        if self.total_inflight >= self.max_inflight:
            raise overloaded(f"the gateway has {self.total_inflight} requests in flight (bound {self.max_inflight})",
                             "overloaded", 1)
        st.inflight += 1
        self.total_inflight += 1
        if tpm:
            st.window.append((now, tokens))
            st.window_tokens += tokens
        return Ticket(tenant=tenant.name, tokens=tokens, ts=now)

    def release(self, ticket: Ticket, *, refund: bool = False) -> None:
        """End a request; ``refund`` returns its tokens to the quota (it never reached the scheduler)."""
        if ticket.released:
            return
        ticket.released = True
        st = self._tenants[ticket.tenant]
        st.inflight -= 1
        self.total_inflight -= 1
        if refund:
            for i, (ts, tok) in enumerate(st.window):
                if ts == ticket.ts and tok == ticket.tokens:
                    del st.window[i]
                    st.window_tokens -= tok
                    break

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
