"""Per-request journey in Redis: ``{prefix}req:{request_id}`` hash, written by the scheduler and workers.

Fields: tenant, gateway, state (queued|assigned|running|done|failed|cancelled|rejected), device, kv_blocks,
attempt, worker_id, and ``*_ts`` timestamps per transition. Terminal requests expire after ``TERMINAL_TTL_S`` so
``slicesched inspect request`` can show recent journeys.
"""
from __future__ import annotations

TERMINAL_STATES = frozenset({"done", "failed", "cancelled", "rejected"})
TERMINAL_TTL_S = 3600


def req_key(prefix: str, request_id: str) -> str:
    return f"{prefix}req:{request_id}"


def assigned_key(prefix: str, device: str) -> str:
    """Set of request ids the scheduler has placed on ``device`` and not yet seen finish."""
    return f"{prefix}sched:assigned:{device}"


def tenant_stats_key(prefix: str, tenant: str) -> str:
    """Hash the scheduler keeps per tenant: queued, running, admitted, rejected, ts (read by gateway, inspect)."""
    return f"{prefix}sched:tenant:{tenant}"
