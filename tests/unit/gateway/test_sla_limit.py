"""The SLA-driven adaptive limit: off until a request is late, cut once per generation, grows back when in use;
wired into admission as 503 ``tenant_saturated`` with Retry-After."""
from __future__ import annotations

import pytest

from services.gateway.admission import Admission
from services.gateway.core import ApiError, GatewayLimits
from services.gateway.sla_limit import DECREASE, MIN_LIMIT, SlaLimiter
from shared.config import ConfigError, parse_tenants

TENANTS = parse_tenants({"tenants": [
    {"name": "t", "model": "tiny", "sla": {"ttft_ms": 2000, "tpot_ms": 100}, "home_devices": ["d"], "max_queue": 64},
]})
T = TENANTS.get("t")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def lim() -> SlaLimiter:
    return SlaLimiter(ttft_target_s=1.0, tpot_target_s=0.05, max_limit=64)


def test_no_limit_below_max_queue_until_a_request_is_late():
    s = lim()
    assert s.current == 64 and s.allows(63) and not s.allows(64)
    for _ in range(100):
        s.observe(generation=0, inflight=10, ttft_s=0.2, tpot_s=0.01)
    assert s.current == 64 and s.cuts == 0
    small = SlaLimiter(ttft_target_s=1.0, tpot_target_s=0.05, max_limit=3)
    small.observe(generation=0, inflight=3, ttft_s=5.0, tpot_s=None)
    assert small.current == 3  # never above max_queue, even at the floor


def test_a_late_request_cuts_to_a_fraction_of_the_inflight_once_per_generation():
    s = lim()
    s.observe(generation=0, inflight=40, ttft_s=1.5, tpot_s=0.01)
    assert s.current == int(40 * DECREASE) and s.generation == 1
    s.observe(generation=0, inflight=40, ttft_s=3.0, tpot_s=0.01)  # admitted before the cut: no second cut
    assert s.current == int(40 * DECREASE) and s.cuts == 1
    s.observe(generation=1, inflight=25, ttft_s=0.1, tpot_s=0.2)  # TPOT over target, admitted after the cut
    assert s.current == int(min(40 * DECREASE, 25) * DECREASE) and s.cuts == 2
    for g in range(2, 20):
        s.observe(generation=g, inflight=3, ttft_s=9.0, tpot_s=None)
    assert s.current == MIN_LIMIT  # a few requests in flight are never refused for being late


def test_on_time_requests_raise_the_limit_only_when_it_is_used():
    s = lim()
    s.observe(generation=0, inflight=20, ttft_s=2.0, tpot_s=None)
    before = s.limit
    for _ in range(10):
        s.observe(generation=1, inflight=2, ttft_s=0.1, tpot_s=0.01)  # well under half the limit: no evidence
    assert s.limit == before
    for _ in range(50):
        s.observe(generation=1, inflight=int(s.limit), ttft_s=0.1, tpot_s=0.01)
    assert before + 2 < s.limit <= 64


def test_admission_rejects_over_the_learned_limit_with_503_and_retry_after():
    clock = Clock()
    adm = Admission(1000, sla_fraction=0.5, clock=clock)
    tickets = [adm.admit(T, 32) for _ in range(20)]
    assert adm.limit("t") == 64
    clock.t += 1.5  # first token 1.5 s after admission: over 0.5 x 2 s
    adm.progress(tickets[0], tokens=1, finished=False)
    clock.t += 0.1
    adm.progress(tickets[0], tokens=15, finished=True, completion_tokens=16)
    adm.release(tickets[0])
    assert adm.limit("t") == int(20 * DECREASE)  # 20 in flight when the late request finished
    with pytest.raises(ApiError) as e:
        adm.admit(T, 32)
    assert (e.value.status, e.value.code, e.value.outcome) == (503, "tenant_saturated", "rejected_overload")
    assert e.value.headers() == {"Retry-After": "1"}
    for t in tickets[1:7]:
        adm.release(t)  # errors or cancels: no SLA sample, only a freed slot
    assert adm.inflight("t") == 13 and adm.limit("t") == 14
    adm.admit(T, 32)


def test_tpot_is_measured_from_the_first_token_over_the_completion_tokens():
    clock = Clock()
    adm = Admission(1000, sla_fraction=0.5, clock=clock)
    tickets = [adm.admit(T, 32) for _ in range(30)]
    adm.progress(tickets[1], tokens=1, finished=False)
    clock.t += 15 * 0.04  # 40 ms per token after the first: within 0.5 x 100 ms
    adm.progress(tickets[1], tokens=15, finished=True, completion_tokens=16)
    assert adm.limit("t") == 64
    adm.progress(tickets[0], tokens=1, finished=False)
    clock.t += 15 * 0.06  # 60 ms per token after the first: over 0.5 x 100 ms
    adm.progress(tickets[0], tokens=15, finished=True, completion_tokens=16)
    assert adm.limit("t") == int(30 * DECREASE)


def test_limiter_off_with_fraction_zero():
    clock = Clock()
    adm = Admission(1000, sla_fraction=0.0, clock=clock)
    t = adm.admit(T, 32)
    clock.t += 30
    adm.progress(t, tokens=1, finished=True, completion_tokens=1)
    assert adm.limit("t") is None
    assert len([adm.admit(T, 32) for _ in range(63)]) == 63


def test_sla_fraction_from_env():
    assert GatewayLimits.from_env({}).admit_sla_fraction == 0.5
    assert GatewayLimits.from_env({"SLICESCHED_ADMIT_SLA_FRACTION": "0"}).admit_sla_fraction == 0.0
    assert GatewayLimits.from_env({"SLICESCHED_ADMIT_SLA_FRACTION": "0.8"}).admit_sla_fraction == 0.8
    for bad in ("-1", "nan", "x"):
        with pytest.raises(ConfigError, match="SLICESCHED_ADMIT_SLA_FRACTION"):
            GatewayLimits.from_env({"SLICESCHED_ADMIT_SLA_FRACTION": bad})


def test_router_feeds_chunks_in_order_and_only_the_owners():
    from services.gateway.tokens import TokenRouter
    from shared.messages import TokenChunk

    def chunk(seq, tenant="t", finish=None):
        return TokenChunk(msg_id=f"c{seq}{tenant}", request_id="r1", tenant=tenant, seq=seq, token_ids=[seq],
                          text="x", finish_reason=finish, completion_tokens=seq + 1)

    seen = []
    r = TokenRouter(cmd=None, blocking=None, stream="s")
    r.register("r1", "t", on_chunk=lambda c: seen.append(c.seq))
    for c in (chunk(1), chunk(0, tenant="other"), chunk(0), chunk(2, finish="length"), chunk(1)):
        r.dispatch(c)
    assert seen == [0, 1, 2]  # reordered, the foreign chunk and the duplicate never reach the admission
