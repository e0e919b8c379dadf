"""The overload bench's pure parts: seeded Poisson arrivals, Retry-After checks, the phase figures and the table."""
from __future__ import annotations

import pytest

from loadgen.report import RequestRecord, SlaTarget
from bench.bench_overload import Seen, _valid_retry_after, arrivals, phase_summary, render_table

SLA = SlaTarget(2.0, 0.1)


def test_arrivals_are_seeded_poisson_within_the_duration():
    a = arrivals(20.0, 50.0, 7, "t", 16, 16, "x")
    assert a == arrivals(20.0, 50.0, 7, "t", 16, 16, "x") and a != arrivals(20.0, 50.0, 8, "t", 16, 16, "x")
    assert 900 < len(a) < 1100 and all(0 < r.arrival_s < 50 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert len({r.request_id for r in a}) == len(a) and a[0].input_tokens == 16 and a[0].tenant == "t"


@pytest.mark.parametrize("value, ok", [("1", True), ("60", True), (" 2 ", True), ("0", False), (None, False),
                                       ("", False), ("-1", False), ("soon", False), ("1.5", False)])
def test_retry_after_must_be_whole_seconds(value, ok):
    assert _valid_retry_after(value) is ok


def test_seen_counts_statuses_retry_after_and_accepted_ids():
    seen = Seen()
    seen.add(200, {"X-Request-Id": "r1"})
    seen.add(429, {"Retry-After": "3"})
    seen.add(429, {})
    seen.add(503, {"Retry-After": "1"})
    assert seen.statuses == {200: 1, 429: 2, 503: 1}
    assert seen.retry_after_ok == {429: 1, 503: 1} and seen.accepted_ids == ["r1"]


def _rec(i, status="ok", http=200, ttft=0.1, tpot=0.01, e2e=0.3, out=16, error=None):
    return RequestRecord(id=f"r{i}", tenant="t", arrival_s=i * 0.1, sent_ts=1000 + i * 0.1, status=status,
                         ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, output_tokens=out, http_status=http, error=error)


def test_phase_summary_counts_goodput_rejects_and_lost():
    recs = [_rec(0), _rec(1), _rec(2, ttft=3.0),  # the third is accepted but late
            _rec(3, status="rejected", http=503, ttft=None, tpot=None, e2e=0.01, out=0, error="tenant 't' is 9"),
            _rec(4, status="rejected", http=429, ttft=None, tpot=None, e2e=0.01, out=0, error="queue 256"),
            _rec(5, status="failed", error="stream ended before [DONE]")]
    seen = Seen()
    for st, h in ((200, {}), (200, {}), (200, {}), (503, {"Retry-After": "1"}), (429, {}), (200, {})):
        seen.add(st, h)
    s = phase_summary(recs, seen, ["journey-left"], "t", SLA, 10.0, 1.0, 0.25)
    assert (s["sent"], s["accepted"], s["rejected_429"], s["rejected_503"]) == (6, 4, 1, 1)
    assert (s["retry_after_429"], s["retry_after_503"]) == (0, 1)
    assert s["accepted_sla_attainment"] == pytest.approx(2 / 4) and s["accepted_over_ttft"] == 1
    assert s["lost_client"] == 1 and s["lost"] == 2 and s["failed_after_accept"] == 1
    assert s["goodput_tokens_per_s"] == pytest.approx(32 / s["window_s"])
    assert s["steady_violation_rate"] == 1.0  # arrivals at >= 0.25 s: r3, r4 (rejected) and r5 (failed)
    assert s["reject_reasons"] == {"503 tenant 't' is N": 1, "429 queue N": 1}


def test_render_table_has_a_row_per_multiplier_and_rss_per_service():
    phase = phase_summary([_rec(0)], Seen(), [], "t", SLA, 5.0, 1.0, 0.0) | {
        "peak_rss_mib": {"gateway": 50.2, "worker cpu0": 512.0}, "redis_used_memory_peak_mib": 3.0}
    md = render_table({"phases": {"1": phase, "2": phase | {"peak_rss_mib": {"gateway": 51.0}}}})
    assert "| 1x | 5.0 |" in md and "| 2x | 5.0 |" in md
    assert "| gateway | 50 | 51 |" in md and "| worker cpu0 | 512 | – |" in md
