"""Admission control: per-tenant bounded in-flight and quotas (429), an SLA-driven adaptive per-tenant limit and a
global in-flight bound (503).

Pure and single-threaded (the gateway's event loop); the clock is injected so tests can move time. These are this
instance's own counts; the same bounds across every gateway replica are then checked and counted in Redis
(:mod:`services.gateway.quota_store`, whose refusals :func:`shared_refusal` words like the local ones). The adaptive
limit (:mod:`services.gateway.sla_limit`) stays per instance: it learns from the TTFT and TPOT of the tenant's
completed requests at this gateway, fed by :meth:`Admission.progress` as their chunks arrive.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.gateway.core import ApiError
from services.gateway.sla_limit import SlaLimiter
from shared.config import TenantConfig

WINDOW_S = 60.0


@dataclass
class Ticket:
    """One admitted request; hand it back with :meth:`Admission.release` exactly once."""

    tenant: str
    tokens: int
    ts: float
    released: bool = False
    generation: int = 0  # the tenant limiter's generation at admission
    first_token_ts: float | None = None
    tokens_seen: int = 0
    observed: bool = False


@dataclass
class _TenantState:
    inflight: int = 0
    window: deque = field(default_factory=deque)  # (ts, tokens) charged in the last WINDOW_S
    window_tokens: int = 0
    limiter: SlaLimiter | None = None


class Admission:
    """Decides whether a request may enter: tenant limits first (429), then the tenant's SLA limit and the cluster
    bound (503). ``sla_fraction`` scales the tenant's SLA into the limiter's targets; 0 turns the limiter off."""

    def __init__(self, max_inflight: int, *, sla_fraction: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_inflight = max_inflight
        self.sla_fraction = sla_fraction
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

    def limit(self, tenant: str) -> int | None:
        """The tenant's adaptive limit (None when the limiter is off or has not seen the tenant)."""
        st = self._tenants.get(tenant)
        return st.limiter.current if st and st.limiter else None

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
        lim = self._limiter(tenant, st)
        if lim is not None and not lim.allows(st.inflight):
            raise overloaded(f"tenant '{tenant.name}' is at its adaptive limit of {lim.current} requests in flight "
                             f"(lowered because recent requests missed {self.sla_fraction:g} x the tenant's SLA)",
                             "tenant_saturated", 1)
        if self.total_inflight >= self.max_inflight:
            raise overloaded(f"the gateway has {self.total_inflight} requests in flight (bound {self.max_inflight})",
                             "overloaded", 1)
        st.inflight += 1
        self.total_inflight += 1
        if tpm:
            st.window.append((now, tokens))
            st.window_tokens += tokens
        return Ticket(tenant=tenant.name, tokens=tokens, ts=now, generation=lim.generation if lim else 0)

    def progress(self, ticket: Ticket, *, tokens: int, finished: bool, completion_tokens: int = 0) -> None:
        """A chunk of the request arrived (``tokens`` new tokens); at the end, feed the tenant's SLA limiter."""
        if ticket.released or ticket.observed:
            return
        now = self.clock()
        if tokens and ticket.first_token_ts is None:
            ticket.first_token_ts = now
        ticket.tokens_seen += tokens
        if not finished:
            return
        ticket.observed = True
        st = self._tenants[ticket.tenant]
        if st.limiter is None or ticket.first_token_ts is None:
            return
        n = max(completion_tokens, ticket.tokens_seen)
        tpot = (now - ticket.first_token_ts) / (n - 1) if n > 1 else None
        st.limiter.observe(generation=ticket.generation, inflight=st.inflight,
                           ttft_s=ticket.first_token_ts - ticket.ts, tpot_s=tpot)

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

    def _limiter(self, tenant: TenantConfig, st: _TenantState) -> SlaLimiter | None:
        if self.sla_fraction <= 0:
            return None
        if st.limiter is None:
            st.limiter = SlaLimiter(ttft_target_s=self.sla_fraction * tenant.sla.ttft_ms / 1000.0,
                                    tpot_target_s=self.sla_fraction * tenant.sla.tpot_ms / 1000.0,
                                    max_limit=tenant.max_queue)
        return st.limiter

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


def shared_refusal(tenant: TenantConfig, reason: str, count: int, retry_after_s: int, max_inflight: int) -> ApiError:
    """The 429/503 for a bound that the counts of all gateways together reached (see ``quota_store.py``)."""
    if reason == "queue_full":
        return _quota(f"tenant '{tenant.name}' has {count} requests in flight across the gateways, its queue bound "
                      f"is {tenant.max_queue}", "queue_full", retry_after_s)
    if reason == "concurrency":
        return _quota(f"tenant '{tenant.name}' is at its concurrency quota of {tenant.quota.max_concurrency} "
                      f"requests (across the gateways)", "concurrency_quota_exceeded", retry_after_s)
    if reason == "tokens":
        return _quota(f"tenant '{tenant.name}' would exceed its quota of {tenant.quota.tokens_per_min} tokens per "
                      f"minute (used {count} across the gateways)", "tokens_quota_exceeded", retry_after_s)
    return overloaded(f"the gateways have {count} requests in flight (bound {max_inflight})", "overloaded",
                      retry_after_s)


def _quota(message: str, code: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code=code, retry_after_s=retry_after_s,
                    outcome="rejected_quota")


def overloaded(message: str, code: str, retry_after_s: int) -> ApiError:
    """503 for a saturated or unreachable cluster (also used by the service for Redis trouble and draining)."""
    return ApiError(503, message, type="service_unavailable_error", code=code, retry_after_s=retry_after_s,
                    outcome="rejected_overload")
