"""Metric computation (pure): percentiles, throughput window, SLA violations per DESIGN §9."""
from __future__ import annotations

import pytest

from loadgen.report import RequestRecord, SlaTarget, summarize, summary_markdown, tpot, violates


def rec(i: int, tenant: str = "a", status: str = "ok", ttft: float | None = 0.1, e2e: float | None = 1.0,
        out: int = 10, sent: float = 100.0) -> RequestRecord:
    t = tpot(e2e, ttft, out) if status == "ok" and ttft is not None and e2e is not None else None
    return RequestRecord(id=f"{tenant}-{i}", tenant=tenant, arrival_s=float(i), sent_ts=sent, status=status,
                         ttft_s=ttft, tpot_s=t, e2e_s=e2e, output_tokens=out if status == "ok" else 0,
                         itl=[0.1] * (out - 1) if status == "ok" else [])


def test_tpot_definition():
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None


def test_violation_rules():
    sla = SlaTarget(ttft_s=0.5, tpot_s=0.2)
    assert not violates(rec(0), sla)
    assert violates(rec(0, ttft=0.6), sla)
    assert violates(rec(0, e2e=0.1 + 9 * 0.25), sla)  # TPOT 0.25 > 0.2
    assert violates(rec(0, status="rejected"), sla) and violates(rec(0, status="failed"), sla)
    assert violates(rec(0, status="timeout"), sla)
    assert not violates(rec(0, status="cancelled"), sla)
    assert not violates(rec(0, ttft=9.0), None)


def test_summary_numbers():
    recs = [rec(i, ttft=0.1 * (i + 1), sent=100.0 + i) for i in range(10)]  # a: TTFT 0.1..1.0, finishes 101..110
    recs += [rec(0, "b", status="rejected", e2e=0.01, sent=100.5), rec(1, "b", e2e=2.0, sent=105.0, out=21),
             rec(2, "b", status="timeout", e2e=9.0, sent=101.0), rec(3, "b", status="cancelled", e2e=None, sent=109.0)]
    s = summarize(recs, {"a": SlaTarget(0.55, 1.0), "b": SlaTarget(1.0, 0.05)})
    assert s["window_s"] == [100.0, 110.0] and s["duration_s"] == 10.0
    a, b, tot = s["tenants"]["a"], s["tenants"]["b"], s["total"]
    assert a["completed"] == 10 and a["output_tokens"] == 100 and a["tokens_per_s"] == pytest.approx(10.0)
    assert a["ttft_s"]["p50"] == pytest.approx(0.55) and a["ttft_s"]["p90"] == pytest.approx(0.91)
    assert a["ttft_s"]["p99"] == pytest.approx(0.991)
    assert a["sla_violations"] == 5 and a["violation_rate"] == pytest.approx(0.5)  # TTFT 0.6 … 1.0
    # b: rejected + timeout violate; the ok one has TPOT (2.0 − 0.1)/20 = 0.095 > 0.05; cancelled not judged
    assert b["rejected"] == 1 and b["failed"] == 1 and b["timeouts"] == 1 and b["cancelled"] == 1
    assert b["sla_violations"] == 3 and b["violation_rate"] == pytest.approx(1.0)
    assert tot["requests"] == 14 and tot["sla_violations"] == 8
    assert tot["violation_rate"] == pytest.approx(8 / 13)
    assert s["tokens_per_s"] == pytest.approx(121 / 10.0) and s["violation_rate"] == tot["violation_rate"]
    assert tot["requests_per_s"] == pytest.approx(1.1)
    md = summary_markdown(s | {"partial": True})
    assert "PARTIAL" in md and "| a | 10 | 10 | 0 | 0 | 10.00 |" in md and "**total**" in md


def test_empty_and_explicit_window():
    s = summarize([], {}, tenants=["a"])
    assert s["total"]["requests"] == 0 and s["tenants"]["a"]["ttft_s"]["p50"] is None and s["tokens_per_s"] == 0
    s = summarize([rec(0)], {}, window=(0.0, 20.0))
    assert s["tokens_per_s"] == pytest.approx(0.5)


def test_record_round_trip():
    r = rec(3, status="ok")
    assert RequestRecord.from_dict(r.to_dict() | {"unknown": 1}) == r
