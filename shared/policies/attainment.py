"""A tenant's recent SLA attainment, measured the same way by the offline simulator and the live scheduler (what
:class:`~shared.policies.snapshot.TenantState` carries to the policies as ``violation_rate`` and ``recent_requests``).

Each request counts once, when it ends: violated when its first token came later than its TTFT target or its mean
time per output token after the first was above its TPOT target (the per-request targets of
``shared/costmodel/sla.py``), or when it failed or was never served; a request the client cancelled does not count.
Both counts decay exponentially with the time constant ``tau_s`` (10 minutes), so the rate follows the tenant's
recent minutes rather than its whole history, and a long-running scheduler forgets an old incident.
"""
from __future__ import annotations

import math

ATTAINMENT_TAU_S = 600.0


def missed(ttft_s: float, tpot_s: float | None, targets: tuple[float, float]) -> bool:
    """Whether a served request missed its SLA: TTFT past ``targets[0]`` or TPOT (None: one output token, no TPOT)
    past ``targets[1]``."""
    return ttft_s > targets[0] or (tpot_s is not None and tpot_s > targets[1])


class Attainment:
    """Exponentially decayed counts of one tenant's ended requests and of those that missed their SLA."""

    __slots__ = ("tau_s", "t", "requests", "violations")

    def __init__(self, tau_s: float = ATTAINMENT_TAU_S) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s must be > 0, not {tau_s!r}")
        self.tau_s, self.t = tau_s, None
        self.requests = self.violations = 0.0

    def observe(self, now: float, violated: bool) -> None:
        """One request ended at ``now`` (within or past its SLA)."""
        if self.t is not None and now > self.t:
            k = math.exp((self.t - now) / self.tau_s)
            self.requests *= k
            self.violations *= k
        if self.t is None or now > self.t:
            self.t = now
        self.requests += 1.0
        if violated:
            self.violations += 1.0

    @property
    def rate(self) -> float:
        """Share of the recent requests that missed their SLA (0 before any ended)."""
        return self.violations / self.requests if self.requests > 0 else 0.0
