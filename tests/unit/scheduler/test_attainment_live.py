"""The live scheduler counts each finished request in its tenant's recent attainment as the simulator does
(``shared/policies/attainment.py``): TTFT from the request's arrival at the gateway, TPOT over the tokens after the
first, against the same per-request targets; the snapshot carries the rate to the policy."""
from __future__ import annotations

import uuid

import pytest

from services.scheduler.core import AssignedTable, SchedulerCore
from services.scheduler.policy import load_live_policy
from services.scheduler.policy_bridge import SnapshotBuilder
from shared.config import REPO_CONFIGS, load_cluster, load_tenants
from shared.costmodel.sla import request_targets
from shared.messages import RequestFinished


@pytest.fixture()
def builder():
    cluster = load_cluster(REPO_CONFIGS / "cluster-h100x32.yaml")
    tenants = load_tenants(REPO_CONFIGS / "tenants-16mix.yaml", cluster)
    return SnapshotBuilder(cluster, tenants, SchedulerCore(cluster, tenants, load_live_policy("slice"))), tenants


def _finished(tenant: str, ts: float, ttft_s: float, e2e_s: float, completion: int, outcome: str = "stop",
              prompt: int = 500) -> RequestFinished:
    return RequestFinished(msg_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, tenant=tenant, device="g00",
                           outcome=outcome, prompt_tokens=prompt, completion_tokens=completion, kv_blocks=1, ts=ts,
                           ttft_ms=ttft_s * 1e3, e2e_ms=e2e_s * 1e3)


def test_finished_requests_are_judged_against_their_own_targets_from_arrival(builder):
    b, tenants = builder
    t = tenants.tenants[0]
    ttft_t, tpot_t = request_targets(t.sla, t.model.config, 500, 101)
    now = 5000.0
    # started on the worker 1 s after arrival: within its TTFT target from the worker's start, past it from arrival
    b.request_ended(_finished("t00", now, ttft_t * 0.5, ttft_t * 0.5 + 100 * tpot_t * 0.5, 101),
                    arrival_ts=now - (ttft_t * 0.5 + 100 * tpot_t * 0.5) - 1.0)
    a = b.attainment["t00"]
    assert a.requests == 1 and a.violations == 1
    # on time from arrival, TPOT within target
    b.request_ended(_finished("t00", now, ttft_t * 0.5, ttft_t * 0.5 + 100 * tpot_t * 0.9, 101), arrival_ts=0.0)
    assert a.requests == pytest.approx(2) and a.violations == pytest.approx(1)
    # TPOT past target
    b.request_ended(_finished("t00", now, ttft_t * 0.5, ttft_t * 0.5 + 100 * tpot_t * 1.2, 101), arrival_ts=0.0)
    assert a.violations == pytest.approx(2)
    # failed: missed; cancelled, or no first token on record: not judged
    b.request_ended(_finished("t00", now, 0.0, 0.5, 0, outcome="failed"), arrival_ts=0.0)
    b.request_ended(_finished("t00", now, 0.0, 0.5, 0, outcome="cancelled"), arrival_ts=0.0)
    b.request_ended(_finished("t00", now, 0.0, 0.5, 0, outcome="length"), arrival_ts=0.0)
    assert a.requests == pytest.approx(4) and a.violations == pytest.approx(3)
    b.request_ended(_finished("nobody", now, 0.1, 0.2, 2), arrival_ts=0.0)  # an unknown tenant: ignored
    snap = b.build(now, {}, {}, AssignedTable(), {})
    assert snap.tenants["t00"].violation_rate == pytest.approx(0.75)
    assert snap.tenants["t00"].recent_requests == pytest.approx(4)
    assert snap.tenants["t01"].violation_rate == 0.0 and snap.tenants["t01"].recent_requests == 0.0
