"""Admission: per-tenant queue bound and quotas (429 + Retry-After), global bound (503), sliding minute window."""
from __future__ import annotations

import pytest

from services.gateway.admission import Admission
from services.gateway.core import ApiError
from shared.config import parse_tenants

TENANTS = parse_tenants({"tenants": [
    {"name": "free", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d"], "max_queue": 3},
    {"name": "capped", "model": "tiny", "sla": {"ttft_ms": 1, "tpot_ms": 1}, "home_devices": ["d"],
     "quota": {"max_concurrency": 2, "tokens_per_min": 1000}},
]})
FREE, CAPPED = TENANTS.get("free"), TENANTS.get("capped")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rejected(adm: Admission, tenant, tokens: int) -> ApiError:
    with pytest.raises(ApiError) as e:
        adm.admit(tenant, tokens)
    return e.value


def test_queue_bound_is_429_and_release_frees_a_slot():
    adm = Admission(100)
    tickets = [adm.admit(FREE, 10) for _ in range(3)]
    e = rejected(adm, FREE, 10)
    assert (e.status, e.code, e.type, e.outcome) == (429, "queue_full", "rate_limit_error", "rejected_quota")
    assert e.headers() == {"Retry-After": "1"}
    adm.release(tickets[0])
    adm.release(tickets[0])  # idempotent
    assert adm.inflight("free") == 2 and adm.total_inflight == 2
    adm.admit(FREE, 10)


def test_concurrency_quota():
    adm = Admission(100, clock=Clock())
    a, _ = adm.admit(CAPPED, 1), adm.admit(CAPPED, 1)
    assert rejected(adm, CAPPED, 1).code == "concurrency_quota_exceeded"
    adm.admit(FREE, 1)  # another tenant is unaffected
    adm.release(a)
    adm.admit(CAPPED, 1)


def test_tokens_per_minute_sliding_window():
    clock = Clock()
    adm = Admission(100, clock=clock)
    adm.release(adm.admit(CAPPED, 600))
    clock.t += 30
    adm.release(adm.admit(CAPPED, 300))
    clock.t += 10
    e = rejected(adm, CAPPED, 200)  # 900 used in the last minute
    assert e.code == "tokens_quota_exceeded" and e.status == 429
    assert e.retry_after_s == 20  # the 600 expire 60 s after they were charged
    assert adm.tokens_in_window("capped") == 900
    adm.release(adm.admit(CAPPED, 100))  # exactly 1000 fits
    clock.t += 20.5
    assert adm.tokens_in_window("capped") == 400
    adm.release(adm.admit(CAPPED, 600))


def test_request_larger_than_the_whole_quota():
    adm = Admission(100, clock=Clock())
    e = rejected(adm, CAPPED, 1001)
    assert e.code == "tokens_quota_exceeded" and e.retry_after_s == 60


def test_refund_returns_tokens():
    adm = Admission(100, clock=Clock())
    t = adm.admit(CAPPED, 900)
    adm.release(t, refund=True)
    assert adm.tokens_in_window("capped") == 0 and adm.inflight("capped") == 0
    adm.release(adm.admit(CAPPED, 1000))


def test_global_bound_is_503():
    adm = Admission(2)
    adm.admit(FREE, 1)
    adm.admit(CAPPED, 1)
    e = rejected(adm, FREE, 1)
    assert (e.status, e.code, e.type, e.outcome) == (503, "overloaded", "service_unavailable_error",
                                                     "rejected_overload")
    assert e.headers()["Retry-After"] == "1"


def test_tenant_limit_wins_over_global():
    adm = Admission(2)
    adm.admit(CAPPED, 1)
    adm.admit(CAPPED, 1)
    assert rejected(adm, CAPPED, 1).status == 429  # the flooding tenant is told it is over its quota
