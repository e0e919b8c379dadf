"""The arrival statistics both the simulator and the live scheduler hand to the policies."""
from __future__ import annotations

import pytest

from shared.policies.rates import ArrivalStats


def test_a_burst_reads_as_its_count_over_the_window_not_its_instant_rate():
    st = ArrivalStats(start=0.0, window_s=30.0)
    for i in range(100):  # 100 requests within one second, 40 s after start
        st.observe(40.0 + i * 0.01, 200, 50)
    assert st.rate_rps == pytest.approx(100 / 30)
    assert st.rate(69.0) == pytest.approx(100 / 30)
    assert st.rate(80.0) == 0.0  # the burst has left the window


def test_rate_before_a_full_window_uses_the_time_since_start_at_least_one_second():
    st = ArrivalStats(start=100.0, window_s=30.0)
    st.observe(100.2, 10, 1)
    assert st.rate_rps == pytest.approx(1.0)
    for t in (101.0, 102.0, 103.0, 110.0):
        st.observe(t, 10, 1)
    assert st.rate_rps == pytest.approx(5 / 10.0)


def test_lengths_are_an_ewma_seeded_by_the_first_request():
    st = ArrivalStats()
    st.observe(1.0, 100, 10)
    assert (st.mean_input, st.mean_output) == (100.0, 10.0)
    st.observe(2.0, 300, 30)
    assert st.mean_input == pytest.approx(110.0) and st.mean_output == pytest.approx(11.0)
