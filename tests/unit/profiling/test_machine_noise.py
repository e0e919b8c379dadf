"""The machine-steadiness probe of ``slicesched bench accuracy`` (bench/machine_noise.py)."""
from __future__ import annotations

import pytest

from bench.machine_noise import steadiness, window_stats


def test_window_stats_of_known_durations():
    s = window_stats([1.0, 1.1, 0.9, 2.0, 1.0])
    assert s["windows"] == 5 and s["median_s"] == 1.0
    # deviations from the median: 0, 0.1, 0.1, 1.0, 0 -> median 0.1
    assert s["median_abs_dev"] == pytest.approx(0.1)
    assert s["min"] == pytest.approx(0.9) and s["max"] == pytest.approx(2.0)
    assert window_stats([1.0, 1.0, 1.0])["lag1_autocorr"] == 0.0  # constant: no correlation to report
    with pytest.raises(ValueError):
        window_stats([1.0, 2.0])


def test_steadiness_times_equal_work_per_window():
    """A fake clock that only moves in the work: each call costs 10 ms, and every third window 15 ms — the
    probe sizes windows to about 50 ms (5 calls) and reports that every third one ran 1.5x slower."""
    t = [0.0]
    calls = [0]

    def clock():
        return t[0]

    def work():
        calls[0] += 1
        window = (calls[0] - 6) // 5  # calls 1-5 size the window; then 5 calls per window
        t[0] += 0.015 if window >= 0 and window % 3 == 2 else 0.010

    s = steadiness(1.0, 0.05, work=work, clock=clock)
    assert s["calls_per_window"] == 5 and s["window_s"] == 0.05
    assert s["median_s"] == pytest.approx(0.05) and s["max"] == pytest.approx(1.5)
    assert s["median_abs_dev"] == pytest.approx(0.0, abs=1e-9) and s["p90"] == pytest.approx(1.5)
    assert s["lag1_autocorr"] < 0  # a slow window follows fast ones
    for bad in ((0.0, 0.05), (1.0, 0.0), (0.1, 0.05)):
        with pytest.raises(ValueError):
            steadiness(*bad, work=work, clock=clock)


def test_steadiness_on_this_machine_with_real_work():
    s = steadiness(0.3, 0.02)
    assert s["windows"] >= 3 and s["calls_per_window"] >= 1
    assert s["min"] <= 1.0 <= s["max"] and s["median_abs_dev"] >= 0
