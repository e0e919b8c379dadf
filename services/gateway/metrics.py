"""The gateway's Prometheus metrics (one CollectorRegistry per service, from ServiceShell)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.config import TenantConfig

OUTCOMES = ("ok", "rejected_quota", "rejected_overload", "error", "cancelled", "bad_request")
# Outcomes that count against the tenant's SLA (DESIGN §9: rejected or failed requests violate it).
VIOLATING = ("rejected_quota", "rejected_overload", "error")
UNKNOWN_TENANT = "unknown"


class GatewayMetrics:
    """TTFT/TPOT/E2E histograms, SLA violations, request outcomes and in-flight requests, per tenant."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("slicesched_ttft_seconds", "Time to first token", ["tenant"], registry=registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("slicesched_tpot_seconds", "Time per output token after the first", ["tenant"],
                              registry=registry,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.e2e = Histogram("slicesched_e2e_seconds", "End-to-end request latency", ["tenant"], registry=registry,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.sla_violations = Counter("slicesched_sla_violations_total",
                                      "Requests over the tenant's TTFT or TPOT target, or rejected/failed",
                                      ["tenant"], registry=registry)
        self.requests = Counter("slicesched_requests_total", "Requests by outcome", ["tenant", "outcome"],
                                registry=registry)
        self.inflight = Gauge("slicesched_gateway_inflight", "Requests in flight at this gateway", ["tenant"],
                              registry=registry)

    def outcome(self, tenant: str | None, outcome: str) -> None:
        t = tenant or UNKNOWN_TENANT
        self.requests.labels(t, outcome).inc()
        if outcome in VIOLATING:
            self.sla_violations.labels(t).inc()

    def completed(self, tenant: TenantConfig, *, ttft_s: float | None, e2e_s: float, completion_tokens: int) -> None:
        """Record a successful request and whether it met the tenant's SLA."""
        t = tenant.name
        self.requests.labels(t, "ok").inc()
        self.e2e.labels(t).observe(e2e_s)
        violated = False
        if ttft_s is not None:
            self.ttft.labels(t).observe(ttft_s)
            violated = ttft_s * 1000.0 > tenant.sla.ttft_ms
            if completion_tokens > 1:
                tpot_s = (e2e_s - ttft_s) / (completion_tokens - 1)
                self.tpot.labels(t).observe(tpot_s)
                violated = violated or tpot_s * 1000.0 > tenant.sla.tpot_ms
        if violated:
            self.sla_violations.labels(t).inc()
