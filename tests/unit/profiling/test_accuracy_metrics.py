"""The accuracy metrics are pure functions: exact values on hand-made inputs."""
from __future__ import annotations

import math

import pytest

from shared.costmodel.accuracy import (BucketStats, ape, ape_quantiles, constant_floor, mape, memory_timeline_error,
                                       quantile_errors, segment_errors, value_at)


def test_ape_and_mape():
    assert ape(110.0, 100.0) == pytest.approx(0.10)
    assert ape(90.0, 100.0) == pytest.approx(0.10)
    assert mape([(110.0, 100.0), (1.0, 2.0)]) == pytest.approx((0.10 + 0.5) / 2)
    assert math.isnan(mape([]))
    with pytest.raises(ValueError):
        ape(1.0, 0.0)


def test_ape_quantiles_and_quantile_errors():
    pairs = [(100 + k, 100) for k in range(11)]  # errors 0 .. 10 %
    q = ape_quantiles(pairs, (50, 90))
    assert q["p50"] == pytest.approx(0.05) and q["p90"] == pytest.approx(0.09)
    # medians 6 vs 5: 20 % off, even though no item is more than 20 % off
    assert quantile_errors([2, 6, 10], [1, 5, 9], (50,))["p50"] == pytest.approx(0.2)
    assert math.isnan(ape_quantiles([])["p50"])


def test_bucket_stats_from_sums():
    xs = [1.0, 2.0, 3.0, 6.0]
    st = BucketStats(len(xs), sum(xs), sum(x * x for x in xs))
    mean = 3.0
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 3)
    assert st.mean == pytest.approx(mean) and st.std == pytest.approx(std)
    assert st.cv == pytest.approx(std / mean) and st.rel_se == pytest.approx(std / mean / 2)
    both = st + BucketStats(1, 3.0, 9.0)
    assert both.count == 5 and both.mean == pytest.approx(3.0)


def test_segment_errors_scores_only_common_keys_with_enough_executions():
    measured = {("mlp", 1): BucketStats(100, 100.0, 150.0), ("mlp", 2): BucketStats(50, 100.0, 300.0),
                ("attn", 1): BucketStats(3, 3.0, 3.0), ("head", 1): BucketStats(100, 10.0, 2.0)}
    predicted = {("mlp", 1): BucketStats(10, 11.0), ("mlp", 2): BucketStats(5, 8.0), ("attn", 1): BucketStats(1, 9.0)}
    rows, s = segment_errors(measured, predicted, min_count=10)
    assert [r["key"] for r in rows] == [("mlp", 1), ("mlp", 2)]  # attn: 3 < 10 runs; head: never predicted
    assert rows[0]["error"] == pytest.approx(0.10) and rows[1]["error"] == pytest.approx(-0.20)
    assert s["mape"] == pytest.approx(0.15) and s["keys"] == 2
    # weighted by measured time: both keys spent 100 ms in total
    assert s["weighted_mape"] == pytest.approx(0.15)
    floor = math.sqrt(2 / math.pi) * (rows[0]["rel_se"] + rows[1]["rel_se"]) / 2
    assert s["noise_floor"] == pytest.approx(floor)
    assert segment_errors(measured, {}, 1)[1]["keys"] == 0


def test_value_at_step_function():
    tl = [(0.0, 10), (1.0, 20), (3.0, 5)]
    assert value_at(tl, -1.0) == 10 and value_at(tl, 0.0) == 10 and value_at(tl, 0.99) == 10
    assert value_at(tl, 1.0) == 20 and value_at(tl, 2.5) == 20 and value_at(tl, 9.0) == 5
    assert value_at([], 1.0) == 0.0


def test_memory_timeline_error_as_fraction_of_capacity():
    predicted = [(0.0, 100), (1.0, 300), (2.0, 100)]
    samples = [(0.5, 100), (1.5, 200), (2.5, 150)]  # errors 0, 100, 50 bytes
    e = memory_timeline_error(predicted, samples, capacity=1000)
    assert e["mean"] == pytest.approx(0.05) and e["max"] == pytest.approx(0.10) and e["samples"] == 3
    assert memory_timeline_error(predicted, [], 1000)["samples"] == 0
    with pytest.raises(ValueError):
        memory_timeline_error(predicted, samples, 0)


def test_constant_floor_is_the_spread_of_identical_work():
    # identical values: a constant predicts them exactly
    assert constant_floor([[2.0] * 6])["median"] == 0.0
    # 1, 1, 1, 2, 2: predicting 1 scores 0, 0, 0, 0.5, 0.5 -> median 0; nothing does better
    assert constant_floor([[1.0, 1.0, 1.0, 2.0, 2.0]])["median"] == pytest.approx(0.0)
    # 1, 2, 3, 4, 5: no constant gets three of them right; the best is c = 3.75, 1/4 off 3 and 5
    f = constant_floor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    assert f["median"] == pytest.approx(0.25) and f["items"] == 5 and f["groups"] == 1
    # groups are scored on their own constants and pooled; groups below min_size are left out
    g = constant_floor([[1.0] * 5, [10.0] * 5, [3.0, 4.0]])
    assert g == {"median": 0.0, "items": 10, "groups": 2}
    assert math.isnan(constant_floor([[1.0, 2.0]])["median"])
